"""The package layout holds: the PD protocol loads without torch."""

import subprocess
import sys


def test_pd_protocol_imports_without_torch():
    probe = "import sys, pdserve.disagg.protocol; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
