"""Tokenizing a corpus for the student, cold and read back from the token cache.

    python bench/tokens_cache.py [--texts 500000] [--workdir runs/bench-tokens]

A fresh process tokenizes `--texts` synthetic texts of about 60 tokens with the demo student's tokenizer
(all-MiniLM-L6-v2) through `distill.tokens.cached_tokens`, as a run's phase 1 does, into an empty token cache;
a second fresh process asks for the same. The table gives each one's seconds and peak RSS (VmHWM, memory-mapped
pages included).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

TOKENIZE = """
import sys, time
from pathlib import Path
import numpy as np
from transformers import AutoTokenizer
from distill.tokens import TokenizedTexts
from distill.hub import resolve_model
from distill.tokens import cached_tokens

count, folder = int(sys.argv[1]), Path(sys.argv[2])
vocabulary = ["river", "the", "stone", "of", "a", "city", "was", "built", "north"]
words = np.random.default_rng(0).choice(vocabulary, (count, 45))
texts = [" ".join(row) + f" {i}" for i, row in enumerate(words)]
tokenizer = AutoTokenizer.from_pretrained(resolve_model("sentence-transformers/all-MiniLM-L6-v2"))
started = time.perf_counter()
tokens = cached_tokens(TokenizedTexts, tokenizer, texts, folder, max_length=128, pad_to_multiple_of=1)
tokens.features(list(range(0, count, max(count // 1000, 1))))  # read back a spread of rows
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(time.perf_counter() - started, peak * 1024, float(tokens.lengths.mean()))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=500_000)
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench-tokens"))
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    print("| run | texts | mean tokens | seconds | peak RSS |\n|---|---:|---:|---:|---:|")
    for name in ("cold", "warm"):
        command = [sys.executable, "-c", TOKENIZE, str(args.texts), str(args.workdir)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        seconds, peak, mean = (float(value) for value in done.stdout.split())
        print(f"| {name} | {args.texts:,} | {mean:.1f} | {seconds:.1f} | {peak / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
