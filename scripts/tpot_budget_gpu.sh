#!/usr/bin/env bash
# The TPOT budget on one GPU, one device call (nvidia-h200; carry .whl .deb, see scripts/prepare_gpu_carry.sh):
#   bash scripts/tpot_budget_gpu.sh          # about 8 minutes with the model build
# One server alone under the mix (70% chat 512-2,048 in / 128-384 out, 30% documents 6-8k in / 64-128 out), every
# prompt prefilled on it beside the requests it decodes, llama-3.1-8b preset, bf16, context 16,384. Each RUNS entry
# ROLE:BUDGET_MS starts a fresh server: decode (a decode server taking every request on the router's local path, as
# conditional disaggregation sends them; budget 0 is the alternation of --decode-local-prefill-chunk-size) or
# colocated. Per run, in $OUT: the serving benchmark's TTFT / TPOT / ITL (serving_NAME.json), the server's budget
# counters (budget_NAME.json: `mean_itl_ms` is the mean inter-token time the budget let the running requests have,
# `extends` / `extend_tokens` what it let through, `credit_ms`, the learned `extend_fixed_ms` and
# `extend_us_per_token`), /load sampled every 0.5 s (load_NAME.jsonl), the warm-up's "step costs" log line and the
# server's "TPOT budget" lines (one per 5,000 decode steps with prompts prefilled beside them).
# Knobs (environment): RUNS, RATE (req/s), NUM_PROMPTS.
set -u
: "${RUNS:=decode:0 decode:10 colocated:10}" "${RATE:=2}" "${NUM_PROMPTS:=80}"
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
MODEL_DIR=$M/llama-3.1-8b
[ -d "$MODEL_DIR" ] || step 240 make_llama-3.1-8b python3 -m pdserve.tools.make_model --preset llama-3.1-8b \
  --out "$MODEL_DIR"

wait_healthy() {  # PORT PID: up to 600 s
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || return 1
    sleep 1
  done
  return 1
}

PORT=30100
for run in $RUNS; do
  role=${run%%:*} budget=${run##*:}
  name=${role}_budget${budget}
  flags=()
  [ "$role" = decode ] && flags=(--disaggregation-mode decode --disaggregation-transfer-backend tcp)
  python3 -m pdserve.launch_server --model-path "$MODEL_DIR" --port $PORT --context-length 16384 \
    --decode-tpot-budget-ms "$budget" "${flags[@]}" > "$OUT/server_$name.log" 2>&1 &
  server=$!
  if ! wait_healthy $PORT $server; then
    echo "=== $name: the server did not become healthy"; tail -20 "$OUT/server_$name.log"
    kill $server 2> /dev/null; wait $server; PORT=$((PORT + 1)); continue
  fi
  grep -h "step costs" "$OUT/server_$name.log"
  (while kill -0 $server 2> /dev/null; do curl -s "http://127.0.0.1:$PORT/load"; echo; sleep 0.5; done) \
    > "$OUT/load_$name.jsonl" &
  poller=$!
  TAILN=14 step 300 "serving_$name" python3 -m pdserve.bench.serving --backend pdserve \
    --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL_DIR" --dataset mix --num-prompts "$NUM_PROMPTS" \
    --request-rate "$RATE" --slo-ttft-ms 1000 --slo-tpot-ms 10 --label "$name" --output "$OUT/serving_$name.json"
  curl -s "http://127.0.0.1:$PORT/get_server_info" | python3 -c 'import json, sys
s = json.load(sys.stdin)["scheduler"]
print(json.dumps({"tpot_budget": s["tpot_budget"], "num_local_prefills": s.get("num_local_prefills"),
                  "prefill_tokens_per_s": s["prefill_tokens_per_s"], "decode_step_ms": s["decode_step_ms"]}))' \
    | tee "$OUT/budget_$name.json"
  grep -h "TPOT budget" "$OUT/server_$name.log" | tail -3
  kill $poller $server 2> /dev/null
  wait $server
  PORT=$((PORT + 1))
done
python3 -m pdserve.bench.serving plot "$OUT"/serving_*.json -o "$OUT/tpot_budget.png" > /dev/null
