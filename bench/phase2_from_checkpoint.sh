#!/usr/bin/env bash
# Phase 2 alone, changed by flags, from a shared phase-1 checkpoint: one change at a time without phase 1 again.
#
#   bench/phase2_from_checkpoint.sh CHECKPOINT OUT_DIR --config configs/demo_mpnet.yaml [FLAGS...]
#
# CHECKPOINT is the checkpoint a run saved at the end of its phase 1: run the config once with
# `--skip_phase2 True --checkpoint_steps S`, S the phase's optimizer steps (574 for the demo's data at batch 32).
# A resumed run refuses settings other than its checkpoint's; the copy in OUT_DIR has its recorded settings
# cleared, so phase 2 may run with other loss settings. Phase 1's settings and the seed must stay the checkpoint's.
set -euo pipefail
checkpoint=${1:?the phase-1 checkpoint folder}
out=${2:?the output_dir of this run}
shift 2
[ -f "$checkpoint/state.json" ] || { echo "error: $checkpoint is not a checkpoint folder (no state.json)" >&2; exit 2; }
mkdir -p "$out/checkpoints"
cp -r "$checkpoint" "$out/checkpoints/"
"${PYTHON:-python}" - "$out/checkpoints/$(basename "$checkpoint")/state.json" <<'PY'
import json, sys
path = sys.argv[1]
state = json.load(open(path))
state["identity"] = {}
json.dump(state, open(path, "w"))
PY
exec "${PYTHON:-python}" -m distill.train --output_dir "$out" --resume_from_checkpoint latest "$@"
