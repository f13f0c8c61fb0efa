"""What one AdamW step adds to a CPU process's RSS, per parameter: its two moments and its update's temporaries.

    python bench/adamw_memory.py [--parameters 17400000]

The planner counts 16 bytes per trainable float32 parameter beside the weights: 4 of gradient, 8 of AdamW's two
moments and 4 of the temporary its update holds. This measures the last two on a model of the demo student's size
(17.4M parameters in tensors shaped like its layers), in the allocator the process runs on (preload tcmalloc as
`make demo` does to see the demo's figure).
"""

from __future__ import annotations

import argparse

import psutil
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=17_400_000)
    parser.add_argument("--width", type=int, default=384)
    args = parser.parse_args()
    rows = 4 * args.width  # tensors shaped like a layer's MLP weight (width x 4 width)
    count = max(1, args.parameters // (rows * args.width))
    weights = [torch.nn.Parameter(torch.randn(rows, args.width) * 0.02) for _ in range(count)]
    for w in weights:
        w.grad = torch.randn_like(w)
    total = sum(w.numel() for w in weights)
    process = psutil.Process()
    before = process.memory_info().rss
    optimizer = torch.optim.AdamW(weights, lr=1e-4)
    optimizer.step()
    after_one = process.memory_info().rss
    for _ in range(3):
        optimizer.step()
    after = max(after_one, process.memory_info().rss)
    moments = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if v.dim())
    print(f"{total / 1e6:.1f}M float32 parameters in {count} tensors, torch {torch.__version__}")
    print(f"RSS added by the steps: {(after - before) / total:.1f} bytes per parameter")
    print(
        f"  the two moments: {moments / total:.1f}; the update's temporaries: {(after - before - moments) / total:.1f}"
    )


if __name__ == "__main__":
    main()
