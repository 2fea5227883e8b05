"""scripts/ab_trees.sh, the A/B helpers of a lent-GPU call: `overlay` copies this tree's router beside an earlier
tree's pdserve, `in_tree` runs a command on that tree's code (the carried wheels still found), `one_batch` names its
step and output after the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bash(script: str, tmp_path: Path) -> list[str]:
    prelude = (f"export OUT={tmp_path}/out PYTHONPATH={ROOT}:{ROOT}/router:{tmp_path}/site; mkdir -p $OUT; "
               "step() { echo \"step $*\"; }; source scripts/ab_trees.sh; ")
    done = subprocess.run(["bash", "-c", prelude + script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


def test_a_command_runs_on_the_overlaid_tree(tmp_path):
    earlier = tmp_path / "before" / "pdserve"
    earlier.mkdir(parents=True)
    (earlier / "__init__.py").write_text("TREE = 'before'\n")
    lines = run_bash(f"tree=$(overlay {tmp_path}/before); echo $tree; "
                     "in_tree $tree python3 -c 'import sys, pdserve; print(pdserve.TREE, sys.path[1:4])'", tmp_path)
    tree = Path(lines[0])
    assert (tree / "router" / "pdserve_router").is_dir() and lines[1].startswith("before ")
    assert lines[1].endswith(f"['{tree}', '{tree}/router', '{tmp_path}/site']")


def test_one_batch_is_a_step_named_for_its_output(tmp_path):
    lines = run_bash("AB_MODEL=/m AB_FLAGS='--batch-sizes 1 --input-lens 1024' one_batch bs1 90 --quantization fp8",
                     tmp_path)
    assert lines == [f"step 90 bs1 python3 -m pdserve.bench.one_batch --model-path /m --batch-sizes 1 --input-lens 1024 "
                     f"--quantization fp8 --out {tmp_path}/out/bs1"]
