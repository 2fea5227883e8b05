"""The GPU suite's selection (tests/conftest.py): `-m gpu` must finish on one GPU in minutes, so the exhaustive tuner
sweeps run only where `-m` names them (`tuner_sweep`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWEEP = "tests/kernels/test_fp8_rows_linear.py::test_every_fp8_rows_candidate_on_gpu_and_tuner_choice"


def skip_reasons(marks: str, *paths: str) -> str:
    """pytest's short summary of the skips (-rs) running `paths` under `-m marks`."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", marks, *paths],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_sweeps_skip_under_gpu_and_run_where_named():
    assert "an exhaustive sweep: select it with -m tuner_sweep" in skip_reasons("gpu", SWEEP)
    assert "exhaustive sweep" not in skip_reasons("tuner_sweep", SWEEP)

