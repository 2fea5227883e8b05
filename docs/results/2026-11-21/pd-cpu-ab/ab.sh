#!/bin/bash
# A/B of PD added TTFT on CPU: old (7cd2eec, its router) vs new (HEAD, its router), interleaved.
for round in 1 2 3; do
  for side in old new; do
    dir=/work/main; [ $side = old ] && dir=/tmp/oldpd
    (cd $dir && PYTHONPATH=$dir/router timeout 600 nice -n -15 python scripts/pd_check.py --device cpu --model-path /tmp/qtiny --backends tcp mooncake \
      --identity-lens 5 60 300 --ttft-lens 16 256 --reps 30 --out /tmp/ab2/$side-$round > /tmp/ab2/$side-$round.log 2>&1)
    python -c "
import json; r=json.load(open('/tmp/ab2/$side-$round/pd_cpu.json'))
print('$side', $round, 'colo', {k: round(v,2) for k,v in r['colocated_ttft_ms'].items()}, {b: ({k: round(v,2) for k,v in x['added_ttft_ms'].items()}, all(x['identical'])) if 'added_ttft_ms' in x else x.get('error') for b,x in r['backends'].items()})"
  done
done
