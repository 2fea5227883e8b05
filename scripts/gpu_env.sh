# Source on the GPU machine (device tool): installs the carried wheels and Debian libraries, sets the safe NCCL env.
#   carry: .whl .deb      usage: source scripts/gpu_env.sh
# Everything it installs goes to a fresh temporary folder, $SESSION_DIR (site-packages, Debian libraries, models).
SESSION_DIR=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SESSION_DIR/site" .whl/*.whl \
  || return 1
export PYTHONPATH="$PWD:$PWD/router:$SESSION_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$SESSION_DIR/debroot" && for f in .deb/*.deb; do dpkg -x "$f" "$SESSION_DIR/debroot"; done
# Keep only the libraries the image lacks: a carried Debian build must not shadow one the image has.
for lib in "$SESSION_DIR"/debroot/{usr/,}lib/x86_64-linux-gnu/lib*.so.*; do
  ldconfig -p 2>/dev/null | grep -q "/${lib##*/}\$" && rm -f "$lib"
done
export LD_LIBRARY_PATH="$SESSION_DIR/debroot/usr/lib/x86_64-linux-gnu:$SESSION_DIR/debroot/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# step LIMIT NAME CMD...: runs CMD under a time limit into $OUT/NAME.log and prints its exit code and last lines
# (TAILN of them, default 6) without the progress-bar noise. At the limit SIGABRT: Python's fault handler writes
# every thread's stack into the log (a hung step says where it hung; rc 134).
M=${PDSERVE_GPU_MODELS:-$SESSION_DIR/models}  # a fixed folder lets a second call on a warm machine reuse the models
step() {
  local limit=$1 name=$2
  shift 2
  echo "=== $name"
  timeout -s ABRT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -v "Capturing\|Generating\|weights:\|Loading\|tokenizer you are\|warn_once" "$OUT/$name.log" | tail -n "${TAILN:-6}"
}
