#!/usr/bin/env bash
# The test environment, from a fresh clone: what CI's .ci/run installs and what the README's test set-up runs.
# The test tools are pinned in pyproject.toml's `test` extra (a new hypothesis release has broken
# hypothesis-jsonschema before); torch is pinned here because an unpinned one pulls GBs of CUDA wheels.
# Runs as root, or as a user with sudo for the Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
as_root=()
if [ "$(id -u)" -ne 0 ]; then as_root=(sudo --preserve-env=DEBIAN_FRONTEND); fi
# Mooncake's wheel links these even where there is no RDMA NIC; iproute2 builds tests/multihost's hosts.
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq libibverbs1 libnuma1 librdmacm1 iproute2 >/dev/null
# tests/deploy and the router's /dashboard test: systemd-analyze, a real Prometheus, headless Chromium
"${as_root[@]}" apt-get install -y -qq --no-install-recommends systemd prometheus chromium >/dev/null

# torch first and pinned (the CPU build; PDSERVE_TORCH_INDEX overrides where it comes from). Later installs leave it
# alone: nothing after this names a newer torch.
torch_index=()
if [ -n "${PDSERVE_TORCH_INDEX:-}" ]; then torch_index=(--index-url "$PDSERVE_TORCH_INDEX"); fi
python -m pip install -q "${torch_index[@]}" torch==2.13.0
# the test extra pins every test tool, triton (the interpreter runs the GPU kernels' tests on the CPU) included
python -m pip install -q -e ".[test]" -e "./router[fast]"
python -m pip install -q mooncake-transfer-engine-non-cuda
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
python -c "import triton, hypothesis, hypothesis_jsonschema, xgrammar; from mooncake.engine import TransferEngine"
echo "test environment ready: python -m pytest -q"
