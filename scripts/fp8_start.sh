#!/usr/bin/env bash
# Server start to its first /health 200, bf16 against FP8 weights (issue 38), one device call on one GPU (nvidia-h200;
# carry .whl .deb, see scripts/prepare_gpu_carry.sh; timeout_s 600):   bash scripts/fp8_start.sh
# llama-3.1-8b preset (random weights; PRESET=qwen3-0.6b another, whose entries then join the shipped table), default
# server flags; FP8 is `--quantization fp8`. Each start has its own
# --kernel-tuning-cache-dir (Triton's compiled kernels go under it: TRITON_CACHE_DIR is unset), in this order:
#   bf16_empty     bf16, empty cache                                   (its cache then holds the bf16 choices)
#   fp8_empty      FP8, empty cache, no shipped table (PDSERVE_TUNED_TABLES=none): every shape timed, every
#                  candidate compiled, as on a fresh machine before the tables (221 s to a one_batch result, H200)
#   fp8_warm       FP8 on fp8_empty's cache                            target: bf16_warm + 10 s
#   then both caches are exported (`python -m pdserve.tools.export_tuned_table`) into $OUT/tuned/<gpu>.json, the
#   table to commit as pdserve/kernels/tuned/<gpu>.json, and copied there in this machine's tree
#   fp8_table      FP8, empty cache, the shipped table just made        target: <= 60 s
#   fp8_table_serial  the same with PDSERVE_COMPILE_WORKERS=0: every kernel compiled in the server's process, one
#                  after another (the start before `pdserve.kernels.parallel_compile`)
#   bf16_warm      bf16 on bf16_empty's cache
# CASES="NAME ..." runs only those starts (in the order above; the table is made only after fp8_empty ran).
# About 7 minutes with the model build (fp8_empty is most of it). Prints one table; $OUT/fp8_start.json, each
# server's log (server_NAME.log) and its tuners' lines ("N of M from the tuning cache, K from the shipped table").
set -u
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
unset TRITON_CACHE_DIR PDSERVE_TUNING_CACHE_DIR
PRESET=${PRESET:-llama-3.1-8b}
MODEL_DIR=$M/$PRESET
[ -d "$MODEL_DIR" ] || step 240 "make_$PRESET" python3 -m pdserve.tools.make_model --preset "$PRESET" --out "$MODEL_DIR"
CACHES=$(mktemp -d)
PORT=30300
declare -A SECONDS_TO_READY

# start NAME LIMIT CACHE [FLAGS...]: launches a server on CACHE, records the seconds from launch to its first
# /health 200 (or "failed" after LIMIT s, or when it exits), stops it and waits until its GPU memory is freed
start() {
  local name=$1 limit=$2 cache=$3 began server used ready=failed
  shift 3
  echo "=== $name"
  began=$(date +%s.%N)
  python3 -m pdserve.launch_server --model-path "$MODEL_DIR" --port $PORT --kernel-tuning-cache-dir "$cache" "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  server=$!
  while kill -0 $server 2> /dev/null; do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then
      ready=$(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
      break
    fi
    [ "$(awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN { print (b - a > '"$limit"') }')" = 1 ] && break
    sleep 0.2
  done
  SECONDS_TO_READY[$name]=$ready
  echo "ready after $ready s"
  [ "$ready" = failed ] && tail -20 "$OUT/server_$name.log"
  grep -ho "[A-Za-z0-9 ,-]* tuned [0-9]* shapes x rows .* in [0-9.]* s ([^)]*)" "$OUT/server_$name.log" \
    | sed 's/ x rows \[[^]]*\]//' | tee "$OUT/tuners_$name.txt"
  kill $server 2> /dev/null
  wait $server
  for _ in $(seq 30); do  # the children's GPU memory freed (a reading that is no number counts as free)
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [[ "$used" =~ ^[0-9]+$ ]] && [ "$used" -gt 2048 ] || break
    sleep 1
  done
  PORT=$((PORT + 1))
}

want() { [[ " ${CASES:-bf16_empty fp8_empty fp8_warm fp8_table fp8_table_serial bf16_warm} " == *" $1 "* ]]; }

want bf16_empty && PDSERVE_TUNED_TABLES=none start bf16_empty 150 "$CACHES/bf16"
want fp8_empty && PDSERVE_TUNED_TABLES=none start fp8_empty 330 "$CACHES/fp8" --quantization fp8
want fp8_warm && PDSERVE_TUNED_TABLES=none start fp8_warm 120 "$CACHES/fp8" --quantization fp8
if want fp8_empty; then  # the choices just measured become the table (else the shipped one stays)
  if [ "$PRESET" = llama-3.1-8b ]; then  # the table made anew
    TAILN=4 step 30 export_tuned_table python3 -m pdserve.tools.export_tuned_table "$CACHES/bf16" "$CACHES/fp8" \
      --out "$OUT/tuned" --replace
  else  # another preset's entries join the shipped table's
    mkdir -p "$OUT/tuned" && cp pdserve/kernels/tuned/*.json "$OUT/tuned/"
    TAILN=4 step 30 export_tuned_table python3 -m pdserve.tools.export_tuned_table "$CACHES/bf16" "$CACHES/fp8" \
      --out "$OUT/tuned"
  fi
  cp "$OUT"/tuned/*.json pdserve/kernels/tuned/
fi
want fp8_table && start fp8_table 150 "$CACHES/fp8_table" --quantization fp8
want fp8_table_serial && PDSERVE_COMPILE_WORKERS=0 start fp8_table_serial 150 "$CACHES/serial" --quantization fp8
want bf16_warm && PDSERVE_TUNED_TABLES=none start bf16_warm 120 "$CACHES/bf16"

python3 - "$OUT/fp8_start.json" "${SECONDS_TO_READY[bf16_empty]:-}" "${SECONDS_TO_READY[fp8_empty]:-}" \
  "${SECONDS_TO_READY[fp8_warm]:-}" "${SECONDS_TO_READY[fp8_table]:-}" "${SECONDS_TO_READY[fp8_table_serial]:-}" \
  "${SECONDS_TO_READY[bf16_warm]:-}" <<'EOF'
import json, sys

names = ("bf16_empty", "fp8_empty", "fp8_warm", "fp8_table", "fp8_table_serial", "bf16_warm")
seconds = {name: None if value in ("failed", "") else float(value) for name, value in zip(names, sys.argv[2:])}
rows = (("bf16, empty cache", "bf16_empty", None),
        ("FP8, empty cache, no shipped table", "fp8_empty", None),
        ("FP8, warm cache", "fp8_warm", seconds["bf16_warm"] and seconds["bf16_warm"] + 10),
        ("FP8, empty cache, shipped table", "fp8_table", 60.0),
        ("FP8, empty cache, shipped table, compiles in-process", "fp8_table_serial", None),
        ("bf16, warm cache", "bf16_warm", None))
print("| start | seconds to the first /health 200 | target |\n|---|---|---|")
for label, name, limit in rows:
    value = seconds[name]
    verdict = "" if limit is None else f"<= {limit:.1f} s: " + ("met" if value is not None and value <= limit
                                                               else "missed")
    print(f"| {label} | {'not run or failed' if value is None else f'{value:.1f}'} | {verdict} |")
json.dump(seconds, open(sys.argv[1], "w"), indent=1)
EOF
