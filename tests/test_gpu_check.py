"""`make gpu-check` on a machine without CUDA: every check that can run here passes, the CUDA-only ones are
skipped with their reason, and the command exits 0. On a GPU the same script runs every check (bench/gpu_check.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: `make gpu-check` runs the full check")
def test_the_gpu_check_runs_what_a_cpu_can_and_skips_the_rest(tmp_path, capsys):
    assert gpu_check.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    checks = report["checks"]
    assert set(checks) == {
        *(f"student-{model}-{p}" for model in ("bert", "mpnet") for p in ("fp32", "bf16")),
        "e2e-fp32",
        "e2e-bf16",
        "resume",
        "nan",
        "loader",
    }
    assert checks["loader"] == {
        **checks["loader"],
        "status": "skipped",
        "reason": "the loader uses worker processes and pinned memory on CUDA only",
    }
    ran = {name: check for name, check in checks.items() if name != "loader"}
    assert all(check["status"] == "passed" for check in ran.values()), ran
    for precision in ("fp32", "bf16"):
        assert checks[f"e2e-{precision}"]["attention"]["unpadded"] is False
        assert checks[f"student-bert-{precision}"]["vectors_max_abs"] <= gpu_check.TOLERANCES[precision][0]
    assert checks["nan"]["exit_code"] == 3 and checks["resume"]["weights_max_abs"] == 0.0
    assert report["machine"]["device"] == "cpu"


def test_a_failed_check_is_reported_and_fails_the_command(tmp_path, monkeypatch):
    """One check raising: it is 'failed' with its error, the others still run, and the command exits 1."""

    def broken(models, precision):
        raise AssertionError("vectors 0.3 beyond the tolerance")

    monkeypatch.setattr(gpu_check, "check_mpnet", broken)
    for name in ("check_e2e", "check_resume", "check_nan"):  # the whole runs are the other test's
        monkeypatch.setattr(gpu_check, name, lambda *args: {"stand_in": True})
    assert gpu_check.main(["--quick", "--out", str(tmp_path)]) == 1
    checks = json.loads((tmp_path / "gpu-check.json").read_text())["checks"]
    assert checks["student-mpnet-fp32"]["status"] == "failed"
    assert checks["student-mpnet-fp32"]["error"] == "AssertionError: vectors 0.3 beyond the tolerance"
    assert checks["student-bert-fp32"]["status"] == "passed" and checks["resume"]["status"] == "passed"
