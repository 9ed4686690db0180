import json, sys, glob, os
out = sys.argv[1]
print(f"{'run':<14} {'n':>2} {'tok':>3} {'allred':>7} {'norm':>6} {'ar+nrm':>7} {'fused':>7} {'f-ar':>6} ok")
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "unreadable", e); continue
    cell = {}
    for r in d["rows"]:
        cell[(r["world_size"], r["tokens"], r["variant"])] = r
    for (n, t) in sorted({(k[0], k[1]) for k in cell}):
        g = lambda v: cell.get((n, t, v), {}).get("p50_us", float("nan"))
        ok = cell.get((n, t, "fused"), {}).get("correct")
        print(f"{os.path.basename(f)[:-5]:<14} {n:>2} {t:>3} {g('allreduce'):7.2f} {g('norm kernel'):6.2f} {g('allreduce + norm'):7.2f} {g('fused'):7.2f} {g('fused')-g('allreduce'):+6.2f} {ok}")
    for e in d.get("errors", []): print("  error:", e[:200])
