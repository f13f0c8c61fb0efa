"""Run distill.train with one measurement-only change that has no flag, for the ablations in docs/QUALITY.md.

    python bench/ablate.py --random_projection_init -- --config configs/mpnet_projection.yaml [distill flags]

--random_projection_init: the projection starts from nn.Linear's default random init instead of the
orthogonal or least-squares fit (distill always fits it; this patches both fitting functions).
The other ablations of docs/QUALITY.md are flags now: --projection_lr_scale X and
--matryoshka_full_teacher_similarity (pass them after `--`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random_projection_init", action="store_true")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]

    import torch

    import distill.student as student
    from distill.student import dense_module
    from distill.train import main as train_main

    if args.random_projection_init:

        def random_projection(student_embeddings, teacher_embeddings):
            return dense_module()(
                student_embeddings.shape[1],
                teacher_embeddings.shape[1],
                bias=True,
                activation_function=torch.nn.Identity(),
            )

        student.least_squares_projection = student.orthogonal_projection = random_projection
    return train_main(rest)


if __name__ == "__main__":
    sys.exit(main())
