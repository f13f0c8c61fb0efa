"""Run distill.train with one measurement-only change that has no flag (yet), for the ablations in docs/QUALITY.md.

    python bench/ablate.py --random_projection_init -- --config configs/demo_mpnet.yaml [distill flags]

--random_projection_init: the projection starts from nn.Linear's default random init instead of the
least-squares fit (distill always fits it by least squares; this patches that one call).
--mrl_full_teacher_similarity: LossWeights(matryoshka_full_teacher_similarity=True) (no flag yet: train.py
builds LossWeights).
--projection_lr_scale X: the projection's parameters get X times the phase's learning rate (own AdamW group).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random_projection_init", action="store_true")
    parser.add_argument("--projection_lr_scale", type=float, default=None)
    parser.add_argument("--mrl_full_teacher_similarity", action="store_true")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]

    import distill.train as train
    from distill.student import dense_module

    if args.random_projection_init:

        def random_projection(student_embeddings, teacher_embeddings):  # noqa: ANN001, ANN202
            return dense_module()(
                student_embeddings.shape[1],
                teacher_embeddings.shape[1],
                bias=True,
                activation_function=__import__("torch").nn.Identity(),
            )

        train.least_squares_projection = random_projection
    if args.mrl_full_teacher_similarity:
        import dataclasses

        original_settings = train.phase_settings

        def phase_settings(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            settings = original_settings(*a, **kw)
            weights = dataclasses.replace(settings.weights, matryoshka_full_teacher_similarity=True)
            return dataclasses.replace(settings, weights=weights)

        train.phase_settings = phase_settings
    if args.projection_lr_scale is not None:
        import torch

        import distill.training as training

        scale = args.projection_lr_scale

        def make_optimizer(model, lr, weight_decay):  # noqa: ANN001, ANN202
            groups = {}
            for name, parameter in model.named_parameters():
                if not parameter.requires_grad:
                    continue
                key = (name.startswith("projection."), name.endswith(training.NO_DECAY))
                groups.setdefault(key, []).append(parameter)
            return torch.optim.AdamW(
                [
                    {"params": ps, "lr": lr * (scale if proj else 1.0), "weight_decay": 0.0 if nd else weight_decay}
                    for (proj, nd), ps in groups.items()
                ],
                lr=lr,
            )

        training.make_optimizer = make_optimizer
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())
