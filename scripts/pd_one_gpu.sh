#!/usr/bin/env bash
# Colocated vs each PD role alone vs the PD pair sharing one GPU (issue 21), on a lent one-GPU machine (device tool;
# carry .whl .deb):   bash scripts/pd_one_gpu.sh PHASE...
# Loads (pdserve.bench.serving, open-loop Poisson, llama-3.1-8b preset, bf16):
#   mix       70% chat 512-2,048 tokens in + 30% documents 6-8k in, 1-6 tokens out (prefill-bound), RATE req/s
#   decode    256-512 tokens in, 256-512 out (decode-bound), 8 and 16 req/s
# Phases (run in the order given):
#   transfer       raw mooncake writes on one GPU (src and dst on GPU 0): contiguous vs scattered pages
#   colocated      one server: the first 15 s after ready at 2 req/s of the mix (cold), the same 15 s of requests
#                  again (steady), the mix at RATE, the decode load (COLOCATED_DECODE=0 skips it)
#   cold           only the cold and steady runs of `colocated`, the server logging its request timelines
#                  (LABEL=_x names this run's files and pd_one_gpu_x.tgz, e.g. for a run under another environment)
#   prefill_alone  a prefill server with the fake transfer backend, served directly: the mix
#   decode_alone   a decode server with the fake transfer backend, served directly: the decode load
#   pd             prefill + decode on GPU 0 behind the router (mooncake), --max-total-tokens 120000 each, request
#                  timelines on all three: the mix fresh, 30 s of the decode load to fill both pools, the mix again;
#                  then `pdserve.bench.timeline` over the logs (PREFILL_GPU=0 DECODE_GPU=1 on a two-GPU machine
#                  puts each server on its own GPU; PD_FLAGS adds flags to both servers, e.g.
#                  PD_FLAGS="--disaggregation-prefill-ahead-share 0" for the prefill that waits for its page list)
#   cluster        `python -m pdserve.launch_cluster` on the one GPU and the README's curl
# Set PYSPY=1 for py-spy profiles of the servers under the mix. Results land in $OUT/pd_one_gpu.tgz (the device tool
# brings back 8 files at most).
set -u
source scripts/gpu_env.sh || exit 1
export PATH="$SESSION_DIR/site/bin:$PATH"  # py-spy from the carried wheel
nvidia-smi -L
MODEL=${MODEL:-llama-3.1-8b}
RATE=${RATE:-6}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-45}
FINAL_OUT=$OUT
OUT=$FINAL_OUT/r
mkdir -p "$OUT"
trap 'tar czf "$FINAL_OUT/pd_one_gpu${LABEL:-}.tgz" -C "$OUT" . && rm -rf "$OUT"' EXIT
MIX=(--dataset mix --mix-output-scale 0.016 --warmup-requests 4 --disable-progress)
DECODE_LOAD=(--dataset random --random-input-len 512 --random-output-len 512 --random-range-ratio 0.5
             --warmup-requests 4 --disable-progress)

model_dir() {
  [ -d "$M/$MODEL" ] || step 240 "make_$MODEL" python3 -m pdserve.tools.make_model --preset "$MODEL" --out "$M/$MODEL" >&2
  echo "$M/$MODEL"
}

wait_ready() {  # URL...
  local start=$SECONDS
  for url in "$@"; do
    until curl -sf "$url/health" >/dev/null; do
      sleep 1; [ $((SECONDS - start)) -gt 400 ] && { echo "$url not ready after 400 s"; return 1; }
    done
  done
  echo "ready after $((SECONDS - start)) s"
}

bench() {  # NAME URL RATE SECONDS EXTRA...
  local name=$1 url=$2 rate=$3 seconds=$4; shift 4
  local n; n=$(python3 -c "print(max(8, int($rate * $seconds)))")
  step $((seconds + 150)) "$name" python3 -m pdserve.bench.serving --backend pdserve --base-url "$url" \
    --tokenizer "$(model_dir)" --num-prompts "$n" --request-rate "$rate" --output "$OUT/$name.json" "$@"
}

scrape() {  # NAME URL
  curl -s "$2/metrics" | grep -v "^#" > "$OUT/$1.metrics"
}

spy() {  # NAME PID SECONDS
  [ "${PYSPY:-0}" = 1 ] || return 0
  py-spy record --subprocesses --nonblocking --format raw -r 200 -d "$3" -p "$2" -o "$OUT/$1.pyspy" >/dev/null 2>&1 &
}

stop() {  # PID...: SIGTERM, then wait until each is gone (servers started by `serve` are not this shell's children)
  kill "$@" 2>/dev/null
  for pid in "$@"; do
    for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  done
}

serve() {  # LOGNAME ARGS... (prints the pid)
  local log=$1; shift
  python3 -m pdserve.launch_server --model-path "$(model_dir)" "$@" > "$OUT/$log.log" 2>&1 &
  echo $!
}

alone() {  # ROLE PORT: a server of that PD role on the fake transfer backend, served directly (prints the pid)
  serve "$1_alone" --port "$2" --disaggregation-mode "$1" --disaggregation-transfer-backend fake \
    --max-total-tokens 120000
}

decode_loads() {  # NAME_PREFIX URL: the decode-bound load at 8 and 16 req/s
  bench "$1_decode8" "$2" 8 30 "${DECODE_LOAD[@]}"
  bench "$1_decode16" "$2" 16 30 "${DECODE_LOAD[@]}"
}

phase_transfer() {
  step 120 kv_transfer_1gpu python3 -m pdserve.bench.kv_transfer --backends mooncake --sizes-mib 256 \
    --tokens 4096 --page-sizes 16 --patterns contiguous,scattered --iters 5 --src-gpu 0 --dst-gpu 0 --timeout 90
}

cold_and_steady() {  # NAME URL: the first 15 s after ready at 2 req/s of the mix, then the same 30 request shapes
  bench "$1_cold" "$2" 2 15 "${MIX[@]}" --warmup-requests 0  # again with other words: no prefix-cache hits
  scrape "$1_after_cold" "$2"
  bench "$1_steady" "$2" 2 15 "${MIX[@]}" --words-offset 1
}

phase_cold() {
  local pid; pid=$(serve "cold${LABEL:-}" --port 7100 --request-timeline-log "$OUT/timeline_cold${LABEL:-}.jsonl")
  wait_ready http://127.0.0.1:7100 || return
  spy "cold${LABEL:-}" $pid 15
  cold_and_steady "colocated${LABEL:-}" http://127.0.0.1:7100
  stop $pid
}

phase_colocated() {
  local pid; pid=$(serve colocated --port 7100)
  wait_ready http://127.0.0.1:7100 || return
  cold_and_steady colocated http://127.0.0.1:7100
  spy colocated $pid "$SECONDS_PER_RUN"
  bench colocated_mix http://127.0.0.1:7100 "$RATE" "$SECONDS_PER_RUN" "${MIX[@]}"
  [ "${COLOCATED_DECODE:-1}" = 1 ] && decode_loads colocated http://127.0.0.1:7100
  scrape colocated http://127.0.0.1:7100
  stop $pid
}

phase_prefill_alone() {
  local pid; pid=$(alone prefill 7000)
  wait_ready http://127.0.0.1:7000 || return
  spy prefill_alone $pid "$SECONDS_PER_RUN"
  bench prefill_alone_mix http://127.0.0.1:7000 "$RATE" "$SECONDS_PER_RUN" "${MIX[@]}"
  scrape prefill_alone http://127.0.0.1:7000
  stop $pid
}

phase_decode_alone() {
  local pid; pid=$(alone decode 7001)
  wait_ready http://127.0.0.1:7001 || return
  decode_loads decode_alone http://127.0.0.1:7001
  scrape decode_alone http://127.0.0.1:7001
  stop $pid
}

phase_pd() {
  local common=(--disaggregation-transfer-backend mooncake --max-total-tokens 120000 ${PD_FLAGS:-})
  local p d r
  p=$(CUDA_VISIBLE_DEVICES=${PREFILL_GPU:-0} serve prefill "${common[@]}" --port 7000 --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
    --request-timeline-log "$OUT/timeline_prefill.jsonl")
  d=$(CUDA_VISIBLE_DEVICES=${DECODE_GPU:-0} serve decode "${common[@]}" --port 7001 --disaggregation-mode decode \
    --request-timeline-log "$OUT/timeline_decode.jsonl")
  python3 -m pdserve_router --prefill http://127.0.0.1:7000 --prefill-bootstrap-ports 8998 \
    --decode http://127.0.0.1:7001 --port 8000 --request-timeline-log "$OUT/timeline_router.jsonl" \
    > "$OUT/router.log" 2>&1 &
  r=$!
  wait_ready http://127.0.0.1:7000 http://127.0.0.1:7001 http://127.0.0.1:8000 || return
  spy pd_prefill $p "$SECONDS_PER_RUN"; spy pd_decode $d "$SECONDS_PER_RUN"
  bench pd_mix_fresh http://127.0.0.1:8000 "$RATE" "$SECONDS_PER_RUN" "${MIX[@]}"
  mkdir -p "$OUT/fresh" && cp "$OUT"/timeline_*.jsonl "$OUT/fresh/"
  bench pd_fill http://127.0.0.1:8000 16 30 "${DECODE_LOAD[@]}"
  local before_filled; before_filled=$(wc -l < "$OUT/timeline_router.jsonl")
  bench pd_mix_filled http://127.0.0.1:8000 "$RATE" "$SECONDS_PER_RUN" "${MIX[@]}"
  scrape pd_prefill http://127.0.0.1:7000; scrape pd_decode http://127.0.0.1:7001; scrape pd_router http://127.0.0.1:8000
  stop $r $d $p
  TAILN=40 step 60 timeline_fresh python3 -m pdserve.bench.timeline "$OUT"/fresh/timeline_*.jsonl \
    --json "$OUT/timeline_fresh.json"
  mkdir -p "$OUT/filled"
  for f in "$OUT"/timeline_*.jsonl; do tail -n +"$before_filled" "$f" > "$OUT/filled/${f##*/}"; done
  TAILN=40 step 60 timeline_filled python3 -m pdserve.bench.timeline "$OUT"/filled/timeline_*.jsonl \
    --json "$OUT/timeline_filled.json"
}

phase_cluster() {
  python3 -m pdserve.launch_cluster --port 8000 > "$OUT/cluster.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:8000 || { tail -20 "$OUT/cluster.log"; kill -INT $pid; wait $pid; return; }
  curl -s -m 60 -X POST http://127.0.0.1:8000/generate -H "Content-Type: application/json" \
    -d '{"text": "The capital of France is", "max_new_tokens": 16, "temperature": 0}' | tee "$OUT/cluster_curl.json"
  echo
  grep -i "gpu" "$OUT/cluster.log" | head -5
  kill -INT $pid; wait $pid
}

for phase in "$@"; do
  echo "##### $phase"
  "phase_$phase"
done
