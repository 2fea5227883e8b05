"""GPU check of the host tier: a prefix evicted from the GPU and loaded back from the host gives the same greedy
output as the same prefix hit kept on the GPU."""
import sys
from random import Random

from pdserve import LLM, SamplingParams

model = sys.argv[1]
rng = Random(0)
prefix = [rng.randrange(100, 20000) for _ in range(3000)]
prompts = [prefix + [rng.randrange(100, 20000) for _ in range(16)] for _ in range(2)]
fillers = [[rng.randrange(100, 20000) for _ in range(3000)] for _ in range(6)]
greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
llm = LLM(model, dtype="bfloat16", max_total_tokens=8192, enable_hierarchical_cache=True, hicache_size=8)
first = llm.generate([prompts[0]], greedy, use_tqdm=False)[0]
for f in fillers:  # push the prefix out of the 8k-token GPU pool
    llm.generate([f], greedy, use_tqdm=False)
second = llm.generate([prompts[1]], greedy, use_tqdm=False)[0]
stats = llm.scheduler.radix.tier_stats()["hicache"]
print("hicache counters:", {k: v for k, v in stats.items() if any(v.values())})
print("cached tokens of the second prompt:", second.cached_tokens)
llm.scheduler.radix.close()
del llm
ref = LLM(model, dtype="bfloat16", max_total_tokens=65536)  # the same prefix hit, from GPU pages
ref.generate([prompts[0]], greedy, use_tqdm=False)
expected = ref.generate([prompts[1]], greedy, use_tqdm=False)[0]
print("reference cached tokens:", expected.cached_tokens)
same = list(second.token_ids) == list(expected.token_ids)
print("host-tier output equals recompute:", same, list(second.token_ids)[:8], list(expected.token_ids)[:8])
sys.exit(0 if same else 1)
