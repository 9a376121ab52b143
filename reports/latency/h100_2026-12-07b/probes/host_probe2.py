"""One-off (not committed): which part of an eager call grows after the latency suite ran in
the same process (host_probe.py: HQMQ 19.2 -> 22.6 us, int4 17.0 -> 18.9). Times the parts of
the HQMQ / int4 fast route before the suite, after it, and after each remedy."""
import gc, sys, time
import torch
from kvqbench.suites.bench.latency import host_time as ht
from kvqbench.suites.bench.latency.__main__ import main as lat_main
from kvqbench.suites.bench.toolkit import host_us, HOST_US_CALLS
from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.kernels.cuda import hqmq_decode as hq, decode_attention as cd, library as lib

dev = "cuda"
kw = dict(HOST_US_CALLS)
def us(fn):
    return round(host_us(fn, sync="auto", **kw), 2)
def parts(tag, q, kf, vf, ik, iv):
    decode_attention(q, kf, vf); decode_attention(q, ik, iv)
    plan = hq._lookup(q, kf, vf, None, None, None, None, False)[0]
    row = {
        "hqmq call": us(lambda: decode_attention(q, kf, vf)),
        "int4 call": us(lambda: decode_attention(q, ik, iv)),
        "hqmq fast()": us(lambda: hq.fast(q, kf, vf)),
        "hqmq _lookup": us(lambda: hq._lookup(q, kf, vf, None, None, None, None, False)),
        "hqmq _launch_planned": us(lambda: hq._launch_planned(plan, q, None, None)),
        "empty out": us(lambda: torch.empty((1, 32, 1, 128), dtype=torch.float16, device=dev)),
        "SCRATCH.take": us(lambda: lib.SCRATCH.take(plan.rows_q * plan.nsplit * 130, q.device)),
        "raw stream": us(lambda: lib._raw_stream(0)),
        "capturing": us(lambda: lib._capturing()),
        "q.get_device": us(lambda: q.get_device()),
        "empty_like q": us(lambda: torch.empty_like(q)),
        "pure python": us(lambda: sum(range(200))),
    }
    print(tag, row, flush=True)
kf, vf = ht.flats(ht.SPECS["hqmq"], 1, 32768, 8, 128, device=dev)
ik, iv = ht.flats(ht.SPECS["int4"], 1, 32768, 8, 128, device=dev)
q = torch.randn(1, 32, 1, 128, device=dev).half()
parts("before", q, kf, vf, ik, iv)
parts("before again", q, kf, vf, ik, iv)
res = lat_main(["--out", sys.argv[1], "--tokens", "32768", "--batches", "1", "--no-tune", "--skip-encode", "--skip-memory", "--budget-s", "200"])
import threading, os
print("threads", [t.name for t in threading.enumerate()], "load", os.getloadavg(), flush=True)
parts("after suite", q, kf, vf, ik, iv)
del res; gc.collect()
parts("after del + gc", q, kf, vf, ik, iv)
print("allocator", {k: v for k, v in torch.cuda.memory_stats().items() if k in ("segment.all.current", "active.all.current", "inactive_split.all.current", "num_alloc_retries")}, flush=True)
torch.cuda.empty_cache()
parts("after empty_cache", q, kf, vf, ik, iv)
print("allocator", {k: v for k, v in torch.cuda.memory_stats().items() if k in ("segment.all.current", "active.all.current", "inactive_split.all.current")}, flush=True)
import triton
print("gc objects", len(gc.get_objects()), flush=True)
