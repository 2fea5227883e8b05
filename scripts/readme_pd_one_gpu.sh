#!/usr/bin/env bash
# The README's three PD commands (prefill, decode, router) on one GPU, then the seeds' curl; $1 = model folder.
m=$1; logs=${OUT:-$(mktemp -d)}
python3 -m pdserve.launch_server --model-path "$m" --port 7000 --disaggregation-mode prefill \
  --disaggregation-bootstrap-port 8998 --disaggregation-transfer-backend mooncake --max-total-tokens 65536 > "$logs/prefill.log" 2>&1 &
python3 -m pdserve.launch_server --model-path "$m" --port 7001 --disaggregation-mode decode \
  --disaggregation-transfer-backend mooncake --max-total-tokens 65536 > "$logs/decode.log" 2>&1 &
python3 -m pdserve_router --prefill http://127.0.0.1:7000 --prefill-bootstrap-ports 8998 \
  --decode http://127.0.0.1:7001 --port 8000 > "$logs/router.log" 2>&1 &
start=$SECONDS
until curl -sf localhost:7000/health >/dev/null && curl -sf localhost:7001/health >/dev/null && curl -sf localhost:8000/health >/dev/null; do
  sleep 1; [ $((SECONDS - start)) -gt 200 ] && { echo "not ready after 200 s"; break; }
done
echo "ready after $((SECONDS - start)) s"
curl -s -m 60 -X POST http://localhost:8000/generate -H "Content-Type: application/json" -d '{
    "text": "请介绍一下你自己", "max_new_tokens": 32, "temperature": 0.7}'; echo
curl -s -m 60 -X POST http://localhost:8000/generate -H "Content-Type: application/json" -d '{
    "text": "The capital of France is", "max_new_tokens": 16, "temperature": 0}'; echo
kill %1 %2 %3; wait
for f in prefill decode router; do echo "--- $f"; grep -v "Capturing\|Loading" "$logs/$f.log" | tail -6; done
