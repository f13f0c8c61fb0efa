"""`python -m distill.plan`: the planner's command line (distill/plan/command.py)."""

import sys

from distill.plan.command import main

sys.exit(main())
