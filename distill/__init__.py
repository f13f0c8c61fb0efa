"""distill: distill a large text-embedding teacher into a small SentenceTransformer student."""

from __future__ import annotations

__version__ = "0.1.0"
