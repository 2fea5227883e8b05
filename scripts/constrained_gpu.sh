#!/usr/bin/env bash
# Constrained decoding against unconstrained on one GPU (issue 22's speed check), on a lent one-GPU machine (device
# tool; carry .whl .deb made by `bash scripts/prepare_gpu_carry.sh`, which brings xgrammar):
#   bash scripts/constrained_gpu.sh
# One colocated server on the MODEL preset (llama-3.1-8b, bf16); `pdserve.bench.constrained` at BATCH_SIZES
# (1 64), prompts of INPUT_LEN (512) tokens, OUTPUT_LEN (256) tokens out, REPEATS (3) interleaved runs of each mode,
# then the first compile of a 20-property schema; before the server starts, the same compile on the host alone
# (scripts/grammar_compile_cost.py: tokenizer preparation, first schema, fresh names). About 3 minutes: model ~15 s, server start ~30-60 s, benchmark
# ~1-2 min.
# Results (JSON, PNG, table, server log, grammar metrics) land in $OUT/results.tgz.
set -u
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
python3 -c "import importlib.metadata as m, torch, xgrammar; print('torch', torch.__version__, m.version('xgrammar'))" \
  || { echo "no xgrammar here: carry the wheels of scripts/prepare_gpu_carry.sh"; exit 1; }
MODEL=${MODEL:-llama-3.1-8b}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
REPEATS=${REPEATS:-3}
BATCH_SIZES=${BATCH_SIZES:-1 64}
SERVER_FLAGS=${SERVER_FLAGS:-}  # extra launch_server flags, e.g. --disable-cuda-graph
PORT=7100
FINAL_OUT=$OUT
OUT=$FINAL_OUT/r
mkdir -p "$OUT"
trap 'tar czf "$FINAL_OUT/results.tgz" -C "$OUT" . && rm -rf "$OUT"' EXIT

model_dir="$M/$MODEL"
[ -d "$model_dir" ] || step 240 "make_$MODEL" python3 -m pdserve.tools.make_model --preset "$MODEL" --out "$model_dir"
TAILN=2 step 120 grammar_compile_cost python3 scripts/grammar_compile_cost.py --preset "$MODEL"
python3 -m pdserve.launch_server --model-path "$model_dir" --port $PORT --grammar-backend xgrammar $SERVER_FLAGS \
  > "$OUT/server.log" 2>&1 &
server=$!
start=$SECONDS
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 1
  [ $((SECONDS - start)) -gt 300 ] && { echo "not ready after 300 s"; tail -30 "$OUT/server.log"; kill $server; exit 1; }
done
echo "ready after $((SECONDS - start)) s"

plot=(--plot "$OUT/constrained.png")
python3 -c "import matplotlib" 2>/dev/null \
  || { plot=(); echo "no matplotlib: plot later with 'python -m pdserve.bench.constrained plot'"; }
TAILN=12 step 330 constrained python3 -m pdserve.bench.constrained --base-url "http://127.0.0.1:$PORT" \
  --tokenizer "$model_dir" --batch-sizes $BATCH_SIZES --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
  --repeats "$REPEATS" --compile-repeats 3 --disable-progress --label "$MODEL-bf16" \
  --output "$OUT/constrained.json" "${plot[@]}"
curl -s "http://127.0.0.1:$PORT/metrics" | grep "^pdserve_.*grammar\|^pdserve_constrained" > "$OUT/grammar.metrics"
curl -s "http://127.0.0.1:$PORT/get_server_info" > "$OUT/server_info.json"
kill $server
for _ in $(seq 60); do kill -0 $server 2>/dev/null || break; sleep 0.5; done
grep -v "Capturing\|Loading" "$OUT/server.log" | tail -5
