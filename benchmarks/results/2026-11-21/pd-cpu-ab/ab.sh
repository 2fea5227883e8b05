#!/bin/bash
# A/B of PD added TTFT on CPU: the old code (commit 7cd2eec, its router) vs the new (the change, its router),
# interleaved, three rounds. Writes OUT/{old,new}-ROUND/pd_cpu.json and prints one summary line per run.
#   usage: ab.sh OLD_CHECKOUT NEW_CHECKOUT MODEL_DIR OUT
#   MODEL_DIR: python -m pdserve.tools.make_model --preset qwen3-tiny --out MODEL_DIR
set -u
old=$1 new=$2 model=$3 out=$4
for round in 1 2 3; do
  for side in old new; do
    dir=$new; [ $side = old ] && dir=$old
    (cd "$dir" && PYTHONPATH="$dir/router" timeout 600 nice -n -15 python scripts/pd_check.py --device cpu \
      --model-path "$model" --backends tcp mooncake --identity-lens 5 60 300 --ttft-lens 16 256 --reps 30 \
      --out "$out/$side-$round" > "$out/$side-$round.log" 2>&1)
    python -c "
import json; r=json.load(open('$out/$side-$round/pd_cpu.json'))
print('$side', $round, 'colo', {k: round(v,2) for k,v in r['colocated_ttft_ms'].items()}, {b: ({k: round(v,2) for k,v in x['added_ttft_ms'].items()}, all(x['identical'])) if 'added_ttft_ms' in x else x.get('error') for b,x in r['backends'].items()})"
  done
done
