"""`--mixed_precision auto` resolved on this machine, and oneDNN's kernel cache kept small for bf16 on a CPU."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.parametrize(
    ("cuda", "amx", "avx512_bf16", "chosen"),
    [(False, True, False, "bf16"), (False, False, True, "bf16"), (False, False, False, "no"), (True, True, True, None)],
)
def test_auto_precision_is_bf16_only_on_a_cpu_that_computes_it_natively(
    tmp_path, monkeypatch, cuda, amx, avx512_bf16, chosen
):
    """`auto`: bf16 where the CPU has AMX or AVX512-BF16, float32 where bf16 would be emulated, and on a GPU what
    the accelerate config says (None); every other value is Accelerate's as given."""
    from distill.config import build_config
    from distill.distributed import make_accelerator
    from distill.precision import resolve_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert resolve_precision("auto") == chosen
    assert [resolve_precision(given) for given in ("no", "bf16", None)] == ["no", "bf16", None]
    if not cuda:  # bf16 on a CPU keeps few oneDNN kernels (a user's own setting stands)
        monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
        config = build_config({"log_with": "none", "output_dir": str(tmp_path), "mixed_precision": "auto"})
        assert make_accelerator(config).mixed_precision == chosen
        assert os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == ("8" if chosen == "bf16" else None)
        monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
        make_accelerator(config)
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # a torch without the probes: no native bf16 known
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert resolve_precision("auto") == ("no" if not cuda else None)


def test_the_run_says_what_auto_chose(caplog, monkeypatch):
    """One line for `auto`, naming the precision the Accelerator got and why; none for a precision given outright."""
    import logging

    from accelerate import Accelerator

    from distill.precision import log_auto_precision, resolve_precision

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    accelerator = Accelerator(cpu=True, mixed_precision=resolve_precision("auto"))
    with caplog.at_level(logging.INFO, logger="distill"):
        log_auto_precision(accelerator, "no")
        log_auto_precision(accelerator, "auto")
    assert [r.getMessage().removeprefix("[RANK 0] ") for r in caplog.records] == [  # accelerate's rank prefix
        "mixed precision auto: bf16 (this CPU computes bf16 natively: AVX512-BF16)"
    ]
