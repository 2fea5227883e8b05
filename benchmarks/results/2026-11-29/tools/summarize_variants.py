import json,sys
d=json.load(open(sys.argv[1]))
from collections import defaultdict
g=defaultdict(list)
for r in d["rows"]:
    if r.get("layered"):
        continue
    g[(r["case"],r["kv"])].append(r)
print(d["device"], "copy", round(d["copy_gbps"]))
for k,rs in g.items():
    ok=[r for r in rs if "us" in r]
    bad=[r for r in rs if "us" not in r or r["rel_err"]>2e-2]
    ok.sort(key=lambda r:r["us"])
    print(k, "n",len(rs),"bad",len(bad))
    base=rs[0]
    print("  first", base.get("us"), base.get("frac_copy"))
    for r in ok[:6]:
        print(f"  {r['us']:8.1f} {100*r['frac_copy']:5.1f}% bn{r['block_n']} w{r['num_warps']} s{r['num_stages']} asm{int(r['v_asm'])} hf{int(r['heads_first'])} sp{r['max_splits']} err{r['rel_err']:.1e}")
