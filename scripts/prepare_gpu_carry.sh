#!/usr/bin/env bash
# Fill the git-ignored .whl/ and .deb/ at the repo root with what the lent GPU machine's image lacks, for
# Python 3.12 manylinux x86_64; scripts/gpu_env.sh installs them there (device tool: carry [".whl", ".deb"]).
#   bash scripts/prepare_gpu_carry.sh              mooncake (PD) and xgrammar (structured output): 21 MB of wheels,
#                                                  2 MB of Debian packages (with the 14 MB tree, well under the
#                                                  64 MiB carry; 2026-11-28)
#   bash scripts/prepare_gpu_carry.sh structured   the same and py-spy (`pd_one_gpu.sh cold` with PYSPY=1)
#
# Not carried: nvidia-nccl-cu12 (the image's torch 2.11+cu130 brings nvidia-nccl-cu13, whose
# nvidia/nccl/lib/libnccl.so.2 serves a ctypes binding; the cu12 wheel alone is far over the 64 MiB carry limit);
# aiohttp, requests, msgpack, numpy, tqdm, transformers, safetensors, tokenizers, triton (in the image).
# Debian packages: what mooncake's engine.so links and auditwheel leaves out (libibverbs, libmlx5, libnuma, libcurl)
# and their less common dependencies; gpu_env.sh drops the libraries the machine already has.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  pyzmq==27.3.0
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  typing-extensions==4.16.0
  httptools==0.9.0
  prometheus-client==0.26.0
  jsonschema==4.26.0  # the structured-output test modules import it at collection (`pytest -m gpu` collects them)
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==0.30.0
  attrs==26.1.0
)
WHEELS+=(mooncake-transfer-engine-cuda13==0.3.14 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2)
if [ "${1:-}" = structured ]; then
  WHEELS+=(py-spy==0.4.1)
fi
DEBS=(
  libibverbs1 ibverbs-providers librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200
  libcurl4 libnghttp2-14 librtmp1 libssh2-1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2
)
LIMIT_MIB=55

rm -rf .whl .deb
mkdir -p .whl .deb
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
(cd .deb && apt-get download -q "${DEBS[@]}")
# PD needs mooncake's transfer engine only: drop the store, collective and EP libraries and the command-line
# binaries (about 70% of the wheel), so that the carry and the grown tree stay under the 64 MiB a call takes.
slim_wheel() {
  local wheel=$1 dir
  dir=$(mktemp -d)
  (cd "$dir" && unzip -q "$OLDPWD/$wheel" &&
    rm -f mooncake/_store.*.so mooncake/_ep.*.so mooncake/libmooncake_pg*.so mooncake/libmooncake_ep_device.so \
      mooncake/mooncake_client mooncake/mooncake_master mooncake/transfer_engine_bench \
      mooncake_transfer_engine_cuda13.libs/libetcd_wrapper-*.so &&
    sed -i '/_store\.\|_ep\.\|libmooncake_pg\|libmooncake_ep_device\|mooncake_client\|mooncake_master\|transfer_engine_bench\|libetcd_wrapper-/d' \
      ./*.dist-info/RECORD &&
    rm -f "$OLDPWD/$wheel" && zip -q -r -9 "$OLDPWD/$wheel" .)
  rm -rf "$dir"
}
for wheel in .whl/mooncake_transfer_engine*.whl; do [ -e "$wheel" ] && slim_wheel "$wheel"; done

du -b .whl/* .deb/* | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2}'
total=$(du -cb .whl .deb | tail -1 | cut -f1)
printf 'total %.2f MiB (limit %d MiB)\n' "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "carry too large" >&2
  exit 1
fi
