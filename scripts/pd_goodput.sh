#!/usr/bin/env bash
# Issue 35's goodput comparison, one device call (carry .whl .deb; see scripts/prepare_gpu_carry.sh):
#   bash scripts/pd_goodput.sh 2    # nvidia-h200-x2: 1p1d-balanced, colocated x2, 1p1d, two repeats (about 9.5
#                                   # minutes; or REPEATS=1 DURATION=15 in two calls, LABEL=_a / _b, and merge)
#   bash scripts/pd_goodput.sh 4    # nvidia-h200-x4: colocated x4, 3p1d, 2p2d-balanced, 2p2d-balanced-roles at
#                                   # 14-32 req/s (one repeat, about 4 minutes on a warm machine; twice and merge)
# `python -m pdserve.bench.sweep` on the mix (70% chat 512-2,048 in / 128-384 out, 30% documents 6-8k in / 64-128
# out), llama-3.1-8b preset, bf16, context 16,384, mooncake, SLO TTFT <= 1,000 ms and TPOT <= 10 ms, open-loop
# Poisson, streamed, ignore_eos. Layouts interleave across repeats; each start is a fresh cluster.
# Knobs (environment): RATES (comma-separated), DURATION (s of arrivals per rate), REPEATS, LAYOUTS, LABEL,
# TPOT_BUDGET_MS (the balanced layouts' decode budget; default the sweep's: the TPOT SLO, 10 ms), SERVER_ARGS (more
# flags for every server, e.g. "--decode-tpot-burst-ms 0" for an A/B of two sweeps in one call),
# CALL_SECONDS (560: when the sweep must be done, counted from the script's start; the runs it leaves no room for
# are not started, and the JSON says time_limit_reached).
# Results in $OUT: sweep$LABEL.json, sweep$LABEL.png, logs$LABEL.tgz (every server's and router's log), the steps' logs.
# Repeats from two calls merge into one comparison (spread included) on this machine:
#   python -m pdserve.bench.sweep merge call1/sweep.json call2/sweep.json --out benchmarks/results/DATE/x4
set -u
GPUS=${1:-2}
case $GPUS in
  # the pair the target compares first: if the time limit cuts the second repeat short, plain 1p1d loses it
  # 4, 8 and 12 req/s: issue 35's own measured points (a layout run: ~30 s start, ~15 s a rate, ~10 s stop)
  2) : "${LAYOUTS:=1p1d-balanced,colocated,1p1d}" "${RATES:=4,8,12}" "${REPEATS:=2}" "${DURATION:=6}" ;;
  # 14-32 req/s: colocated x4 saturates near 14, the PD layouts between 20 and 26 (measured 2026-11-28); auto is
  # the measured best (3p1d) for the mix, so the adaptive layout is named as itself
  4) : "${LAYOUTS:=colocated,3p1d,2p2d-balanced,2p2d-balanced-roles}" "${RATES:=14,20,26,32}" "${REPEATS:=1}" \
       "${DURATION:=8}" ;;
  *) echo "usage: $0 2|4" >&2; exit 2 ;;
esac
source scripts/gpu_env.sh || exit 1
nvidia-smi -L
MODEL_DIR=$M/llama-3.1-8b
[ -d "$MODEL_DIR" ] || step 240 make_llama-3.1-8b python3 -m pdserve.tools.make_model --preset llama-3.1-8b \
  --out "$MODEL_DIR"
RUN=$OUT/run${LABEL:-}
export PD_GOODPUT_RUN=$RUN  # every server and router the sweep starts inherits it: `finish` finds any left over
leftovers() { grep -lsxz "PD_GOODPUT_RUN=$RUN" /proc/[0-9]*/environ | cut -d/ -f3; }
finish() {  # a sweep killed at the step's limit leaves its clusters running and its JSON (written after every
  # layout run) undrawn: stop the former (a warm machine's next call gets free GPUs), draw the latter
  kill -9 $(leftovers) 2>/dev/null
  [ -f "$RUN/sweep.json" ] && [ ! -f "$RUN/sweep.png" ] &&
    python3 -m pdserve.bench.sweep plot "$RUN/sweep.json" -o "$RUN/sweep.png" > /dev/null
  tar czf "$OUT/logs${LABEL:-}.tgz" -C "$RUN" logs 2>/dev/null
  cp "$RUN"/sweep.json "$OUT/sweep${LABEL:-}.json" 2>/dev/null
  cp "$RUN"/sweep.png "$OUT/sweep${LABEL:-}.png" 2>/dev/null
  rm -rf "$RUN"
}
trap finish EXIT
# the sweep's own limit stops its clusters in time; the step's limit (SIGABRT) is the backstop
LIMIT=$((${CALL_SECONDS:-560} - SECONDS))
echo "model ready at ${SECONDS} s; the sweep gets $LIMIT s"
TAILN=34 step $((LIMIT + 20)) "sweep${LABEL:-}" python3 -m pdserve.bench.sweep --model-path "$MODEL_DIR" \
  --gpus "$(seq -s, 0 $((GPUS - 1)))" --layouts "$LAYOUTS" --rates "$RATES" --duration "$DURATION" \
  --repeats "$REPEATS" --workload mix --slo-ttft-ms 1000 --slo-tpot-ms 10 --transfer-backend mooncake \
  ${TPOT_BUDGET_MS:+--decode-tpot-budget-ms "$TPOT_BUDGET_MS"} --time-limit "$LIMIT" --out "$RUN" -- \
  --context-length 16384 ${SERVER_ARGS:-}
grep -h "ready after\|layout" "$OUT/sweep${LABEL:-}.log" | head -40
