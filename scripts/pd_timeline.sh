#!/usr/bin/env bash
# Issue 36's timeline targets in one device call on nvidia-h200-x2 (carry .whl .deb; about 4 minutes on a warm
# machine with PDSERVE_GPU_MODELS set, plus ~2 for building the llama-3.1-8b preset on a fresh one):
#   bash scripts/pd_timeline.sh
# 1. PD 1P1D (prefill GPU 0, decode GPU 1, mooncake (BACKEND), receive staging at its default, request timelines on the
#    router and both servers): the mix (pdserve.bench.serving --dataset mix) at 8 req/s for RUN_SECONDS (30), then
#    at 4 req/s for RUN_SECONDS_4 (20).
# 2. Colocated x2 (one server per GPU behind a regular router): the mix at 4 req/s for RUN_SECONDS_4.
# 3. scripts/pd_timeline_report.py over step 1's timelines at 8 req/s: prefill received -> queued p50/p90/p99
#    (target p99 <= 5 ms), kv_writes_issued -> kv_writes_landed p50 against the forward's GPU time (<= + 5 ms),
#    the segments' total against the client's TTFT (within 2%), the decode's kv_landed after the prefill's
#    kv_writes_landed; and PD TTFT p50 at 4 req/s against colocated x2's (<= + 15 ms).
# 4. While time is left (CALL_SECONDS, 230): pdserve.bench.kv_transfer, a fragmented and a scattered 2k-token KV
#    GPU 0 -> GPU 1 over mooncake, in place, packed and staged.
# Results in $OUT: pd_timeline.txt (the report), pd_timeline.json, pd_timeline.tgz (serving JSONs, timelines, the
# full bench.timeline breakdown, every log).
# DRY=1 runs the same steps on the CPU with the qwen3-tiny preset, a few requests each and no device setup
# (OUT defaults to a temporary folder): a check that every entry point and flag still exists.
set -u
BACKEND=${BACKEND:-mooncake}
if [ "${DRY:-0}" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}
  mkdir -p "$OUT"
  export PYTHONPATH="$PWD:$PWD/router${PYTHONPATH:+:$PYTHONPATH}"
  MODEL_PRESET=qwen3-tiny RATE_HIGH=2 RATE_LOW=2 RUN_SECONDS=${RUN_SECONDS:-3} RUN_SECONDS_4=${RUN_SECONDS_4:-3}
  GPU_PREFILL="" GPU_DECODE="" DEVICE_FLAGS=(--device cpu --max-total-tokens 8192 --context-length 1024)
  MIX_SCALE=(--mix-input-scale 0.05 --mix-output-scale 0.05)
  M=$OUT/models
  step() {  # as scripts/gpu_env.sh's
    local limit=$1 name=$2; shift 2
    echo "=== $name"; timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n "${TAILN:-6}" "$OUT/$name.log"
  }
else
  source scripts/gpu_env.sh || exit 1
  nvidia-smi -L
  MODEL_PRESET=llama-3.1-8b RATE_HIGH=8 RATE_LOW=4 RUN_SECONDS=${RUN_SECONDS:-30} RUN_SECONDS_4=${RUN_SECONDS_4:-20}
  GPU_PREFILL=0 GPU_DECODE=1 DEVICE_FLAGS=(--context-length 16384)
  MIX_SCALE=()
fi
CALL_SECONDS=${CALL_SECONDS:-230}
MODEL_DIR=$M/$MODEL_PRESET
[ -d "$MODEL_DIR" ] || step 240 "make_$MODEL_PRESET" python3 -m pdserve.tools.make_model --preset "$MODEL_PRESET" \
  --out "$MODEL_DIR"
RUN=$OUT/pd_timeline
mkdir -p "$RUN/timelines_8" "$RUN/logs"
PIDS=()
finish() {
  kill "${PIDS[@]}" 2>/dev/null
  tar czf "$OUT/pd_timeline.tgz" -C "$RUN" . 2>/dev/null
}
trap finish EXIT

serve() {  # NAME GPU ARGS...: a server in the background, its pid in PIDS
  local name=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu python3 -m pdserve.launch_server --model-path "$MODEL_DIR" "${DEVICE_FLAGS[@]}" "$@" \
    > "$RUN/logs/$name.log" 2>&1 &
  PIDS+=($!)
}

route() {  # NAME ARGS...: a router in the background
  local name=$1; shift
  python3 -m pdserve_router --log-level warning "$@" > "$RUN/logs/$name.log" 2>&1 &
  PIDS+=($!)
}

wait_ready() {  # URL...: every one healthy, or a message and 1 (a server exited, or 300 s passed)
  local start=$SECONDS pid
  for url in "$@"; do
    until curl -sf "$url/health" > /dev/null; do
      for pid in "${PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null || { echo "a process exited before $url was ready:"; tail -n 5 "$RUN"/logs/*.log; return 1; }
      done
      sleep 1; [ $((SECONDS - start)) -gt 300 ] && { echo "$url not ready after 300 s"; return 1; }
    done
  done
  echo "ready after $((SECONDS - start)) s"
}

stop_all() {  # every server and router started so far, and wait until they are gone
  kill "${PIDS[@]}" 2>/dev/null
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  done
  PIDS=()
}

bench() {  # NAME URL RATE SECONDS WORDS [WARMUP]: the mix at RATE for SECONDS after WARMUP (4) uncounted requests;
  # WORDS: the --words-offset, so that no run finds an earlier run's prompts in a prefix cache (the PD and colocated
  # runs at the low rate share theirs, on servers that have not seen it)
  local name=$1 url=$2 rate=$3 seconds=$4 words=$5 warmup=${6:-4}
  TAILN=8 step $((seconds + 120)) "$name" python3 -m pdserve.bench.serving --backend pdserve --base-url "$url" \
    --tokenizer "$MODEL_DIR" --dataset mix "${MIX_SCALE[@]}" --num-prompts "$((rate * seconds))" \
    --request-rate "$rate" --words-offset "$words" --warmup-requests "$warmup" --disable-progress \
    --output "$RUN/$name.json"
}

# 1. PD 1P1D with timelines
serve prefill "$GPU_PREFILL" --port 7000 --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
  --disaggregation-transfer-backend "$BACKEND" --request-timeline-log "$RUN/timeline_prefill.jsonl"
serve decode "$GPU_DECODE" --port 7001 --disaggregation-mode decode --disaggregation-transfer-backend "$BACKEND" \
  --request-timeline-log "$RUN/timeline_decode.jsonl"
route router --prefill http://127.0.0.1:7000 --prefill-bootstrap-ports 8998 --decode http://127.0.0.1:7001 \
  --port 8000 --request-timeline-log "$RUN/timeline_router.jsonl"
wait_ready http://127.0.0.1:7000 http://127.0.0.1:7001 http://127.0.0.1:8000 || exit 1
bench pd_warmup http://127.0.0.1:8000 4 1 1 0
sleep 1  # the timelines then hold the measured requests only, as the client's figures do
: > "$RUN/timeline_router.jsonl"; : > "$RUN/timeline_prefill.jsonl"; : > "$RUN/timeline_decode.jsonl"
bench pd_8 http://127.0.0.1:8000 "$RATE_HIGH" "$RUN_SECONDS" 2 0
sleep 1  # the last lines reach the logs after the answers
cp "$RUN"/timeline_*.jsonl "$RUN/timelines_8/"
bench pd_4 http://127.0.0.1:8000 "$RATE_LOW" "$RUN_SECONDS_4" 3
curl -s http://127.0.0.1:7001/metrics | grep "^pdserve_kv_receive\|^pdserve_kv_transfer" > "$RUN/decode.metrics"
curl -s http://127.0.0.1:7000/metrics | grep "^pdserve_kv_transfer" > "$RUN/prefill.metrics"
stop_all

# 2. colocated x2
serve colocated_0 "$GPU_PREFILL" --port 7100
serve colocated_1 "$GPU_DECODE" --port 7101
route router_colocated --worker http://127.0.0.1:7100 --worker http://127.0.0.1:7101 --port 8100
wait_ready http://127.0.0.1:7100 http://127.0.0.1:7101 http://127.0.0.1:8100 || exit 1
bench colocated_4 http://127.0.0.1:8100 "$RATE_LOW" "$RUN_SECONDS_4" 3
stop_all

# 3. the report
TAILN=60 step 60 timeline_breakdown python3 -m pdserve.bench.timeline "$RUN"/timelines_8/timeline_*.jsonl \
  --json "$RUN/timeline_breakdown.json"
python3 scripts/pd_timeline_report.py --timelines "$RUN"/timelines_8/timeline_*.jsonl --serving "$RUN/pd_8.json" \
  --pd "$RUN/pd_4.json" --colocated "$RUN/colocated_4.json" --json "$OUT/pd_timeline.json" | tee "$OUT/pd_timeline.txt"
echo "staging on the decode:"; cat "$RUN/decode.metrics" | grep receive

# 4. staged vs direct fragmented pages, while the call has time
if [ "${DRY:-0}" != 1 ] && [ $SECONDS -lt $((CALL_SECONDS - 60)) ]; then
  TAILN=20 step $((CALL_SECONDS - SECONDS)) kv_transfer python3 -m pdserve.bench.kv_transfer --backends mooncake \
    --tokens 2048 --page-sizes 16 --patterns fragmented,scattered --pack off,on,staged --iters 5 --timeout 60 \
    --link-gbps 394 --out "$RUN/kv_transfer.json"
fi
echo "done at ${SECONDS} s"
