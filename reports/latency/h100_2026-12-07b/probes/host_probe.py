"""One-off (not committed): why the latency suite's host column reads above host_time.
Same process: host_time's figure, then the latency suite at B=1 T=32k, then host_time again
(and with gc off), then the suite's own callables re-timed."""
import gc, json, sys, time
import torch
from kvqbench.suites.bench.latency import host_time as ht
from kvqbench.suites.bench.latency.__main__ import main as lat_main
from kvqbench.suites.bench.toolkit import host_us, HOST_US_CALLS
F = ["int4", "fp8", "kivi4", "hqmq", "med3"]
def table(tag):
    r = {f: round(ht.stubbed_host_us(ht.SPECS[f], 1, 32768, d=128), 1) for f in F}
    rs = {f: round(ht.stubbed_host_us(ht.SPECS[f], 1, 32768, d=128, step=True), 1) for f in F}
    print(tag, "fixed", r, "step", rs, flush=True)
for f in F:
    ht.stubbed_host_us(ht.SPECS[f], 1, 32768, d=128, n=10)
table("before suite")
res = lat_main(["--out", sys.argv[1], "--tokens", "32768", "--batches", "1", "--no-tune", "--skip-encode", "--skip-memory", "--budget-s", "200"])
rows = [r for r in res.get("latency", []) if isinstance(r, dict) and "host_us" in r] if isinstance(res, dict) else []
print("suite host_us:", {r["method"]: (round(r["host_us"], 1), round(r.get("host_us_step", float("nan")), 1)) for r in rows}, flush=True)
table("after suite")
gc.disable(); table("after suite, gc off"); gc.enable()
print("gc counts", gc.get_count(), "objects", len(gc.get_objects()), flush=True)
