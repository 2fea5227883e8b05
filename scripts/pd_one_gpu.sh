#!/usr/bin/env bash
# Colocated vs the PD pair sharing one GPU (issue 21), on a lent one-GPU machine (device tool; carry .whl .deb):
#   bash scripts/pd_one_gpu.sh PHASE...
# Phases (each a function below; run in the order given):
#   transfer     raw mooncake writes on one GPU (src and dst on GPU 0): contiguous vs scattered pages
#   colocated    one server; the prefill-bound mix at 6 req/s for 30 s right after ready (cold), then again (warm)
#   prefill_alone  a PD prefill server (mooncake) served directly: requests carry the fake bootstrap host, so it
#                prefills, hands the KV to nobody and answers with the first token; cold, then warm
#   pd           prefill + decode on GPU 0 behind the router; the mix at 6 req/s fresh, 30 s of decode-bound load
#                to fill both pools, the mix again; py-spy profiles of both roles when PYSPY=1
# Results (serving JSON, server logs, /metrics scrapes, profiles) land in $OUT/results.tgz (the device tool brings
# back 8 files at most).
set -u
source scripts/gpu_env.sh || exit 1
export PATH="$SESSION_DIR/site/bin:$PATH"  # py-spy from the carried wheel
nvidia-smi -L
MODEL=${MODEL:-llama-3.1-8b}
RATE=${RATE:-6}
FINAL_OUT=$OUT
OUT=$FINAL_OUT/r
mkdir -p "$OUT"
trap 'tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && rm -rf "$OUT"' EXIT
FAKE_PEER='{"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}'
MIX=(--dataset mix --mix-output-scale 0.016 --request-rate "$RATE" --warmup-requests 4 --disable-progress)
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

bench() {  # NAME URL SECONDS EXTRA...
  local name=$1 url=$2 seconds=$3; shift 3
  local n=$(python3 -c "print(max(8, int($RATE * $seconds)))")
  step $((seconds + 120)) "$name" python3 -m pdserve.bench.serving --backend pdserve --base-url "$url" \
    --tokenizer "$(model_dir)" --num-prompts "$n" --output "$OUT/$name.json" "$@"
}

scrape() {  # NAME URL
  curl -s "$2/metrics" | grep -v "^#" > "$OUT/$1.metrics"
}

phase_transfer() {
  step 120 kv_transfer_1gpu python3 -m pdserve.bench.kv_transfer --backends mooncake --sizes-mib 256 \
    --tokens 4096 --page-sizes 16 --patterns contiguous,scattered --iters 5 --src-gpu 0 --dst-gpu 0 --timeout 90
}

phase_colocated() {
  local m; m=$(model_dir)
  python3 -m pdserve.launch_server --model-path "$m" --port 7100 > "$OUT/colocated.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:7100
  bench colocated_mix_cold http://127.0.0.1:7100 30 "${MIX[@]}"
  bench colocated_mix_warm http://127.0.0.1:7100 30 "${MIX[@]}"
  scrape colocated http://127.0.0.1:7100
  kill $pid; wait $pid
}

phase_prefill_alone() {
  local m; m=$(model_dir)
  python3 -m pdserve.launch_server --model-path "$m" --disaggregation-transfer-backend mooncake \
    --max-total-tokens 120000 --port 7000 --disaggregation-mode prefill > "$OUT/prefill_alone.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:7000
  bench prefill_alone_mix_cold http://127.0.0.1:7000 30 "${MIX[@]}" --extra-body "$FAKE_PEER"
  [ "${PYSPY:-0}" = 1 ] && py-spy record --subprocesses --nonblocking --format raw -r 200 -d 35 -p $pid \
    -o "$OUT/prefill_alone.pyspy" >/dev/null 2>&1 &
  bench prefill_alone_mix_warm http://127.0.0.1:7000 30 "${MIX[@]}" --extra-body "$FAKE_PEER"
  scrape prefill_alone http://127.0.0.1:7000
  kill $pid; wait $pid
}

phase_pd() {
  local m; m=$(model_dir)
  local common=(--model-path "$m" --disaggregation-transfer-backend mooncake --max-total-tokens 120000)
  python3 -m pdserve.launch_server "${common[@]}" --port 7000 --disaggregation-mode prefill \
    --disaggregation-bootstrap-port 8998 > "$OUT/prefill.log" 2>&1 &
  local p=$!
  python3 -m pdserve.launch_server "${common[@]}" --port 7001 --disaggregation-mode decode > "$OUT/decode.log" 2>&1 &
  local d=$!
  python3 -m pdserve_router --prefill http://127.0.0.1:7000 --prefill-bootstrap-ports 8998 \
    --decode http://127.0.0.1:7001 --port 8000 > "$OUT/router.log" 2>&1 &
  local r=$!
  wait_ready http://127.0.0.1:7000 http://127.0.0.1:7001 http://127.0.0.1:8000
  local spy=()
  if [ "${PYSPY:-0}" = 1 ]; then
    py-spy record --subprocesses --nonblocking --format raw -r 200 -d 40 -p $p -o "$OUT/prefill.pyspy" >/dev/null 2>&1 &
    spy+=($!)
    py-spy record --subprocesses --nonblocking --format raw -r 200 -d 40 -p $d -o "$OUT/decode.pyspy" >/dev/null 2>&1 &
    spy+=($!)
  fi
  bench pd_mix_fresh http://127.0.0.1:8000 30 "${MIX[@]}"
  scrape pd_prefill_fresh http://127.0.0.1:7000; scrape pd_decode_fresh http://127.0.0.1:7001
  bench pd_fill http://127.0.0.1:8000 30 --dataset random --random-input-len 512 --random-output-len 384 \
    --random-range-ratio 0.5 --request-rate 16 --disable-progress
  bench pd_mix_filled http://127.0.0.1:8000 30 "${MIX[@]}"
  scrape pd_prefill_filled http://127.0.0.1:7000; scrape pd_decode_filled http://127.0.0.1:7001
  for s in "${spy[@]}"; do wait "$s"; done
  kill $r $d $p; wait $r $d $p
}

for phase in "$@"; do
  echo "##### $phase"
  "phase_$phase"
done
