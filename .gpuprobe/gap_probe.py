"""One-off (not committed): where a CUDA decode call's time goes at T=32k, d 128: the split
kernel, the combine, and the gaps, from a torch.profiler trace of eager calls back to back
(the host far ahead of the GPU), PDL off then on. Prints per format and B the medians."""
import json, os, statistics as st, sys, tempfile
import torch
from torch.profiler import profile, ProfilerActivity
from kvqbench.kernels.cuda import library
from kvqbench.kernels.decode_attention import decode_attention
from kvqbench.suites.bench.toolkit import kernel_flats

SPECS = {"int4": "int4", "fp8": "fp8", "kivi4": "kivi:bits=4", "kivi2": "kivi:bits=2", "hqmq": "hqmq:S=96,r=4",
         "med3": "hqmq:S=96,r=4,outliers=med3"}
out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
for B in (8, 1):
    for name, spec in SPECS.items():
        kf, vf = kernel_flats(spec, B, 32768, 8, 128, 288 if spec.startswith("kivi") else 256, "cuda")
        q = torch.randn(B, 32, 1, 128, device="cuda").half()
        for on in (False, True):
            with library.PDL.set(on):
                for _ in range(5):
                    decode_attention(q, kf, vf)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(30):
                        decode_attention(q, kf, vf)
                    torch.cuda.synchronize()
            f = os.path.join(tempfile.gettempdir(), "trace.json")
            prof.export_chrome_trace(f)
            ev = [e for e in json.load(open(f))["traceEvents"] if e.get("cat") == "kernel"]
            ev.sort(key=lambda e: e["ts"])
            calls, cur = [], []
            for e in ev:  # a call: its split kernel(s) (KIVI: main and tail), then its combine
                if "combine" in e["name"]:
                    if cur:
                        calls.append((cur, e))
                    cur = []
                else:
                    cur.append(e)
            rows, nxt = [], []
            for i, (sp, c_) in enumerate(calls):
                s0, s1 = sp[0]["ts"], max(x["ts"] + x["dur"] for x in sp)
                rows.append((s1 - s0, c_["dur"], c_["ts"] - s1, c_["ts"] + c_["dur"] - s0))
                if i + 1 < len(calls):
                    nxt.append(calls[i + 1][0][0]["ts"] - (c_["ts"] + c_["dur"]))
            med = [st.median(x) for x in zip(*rows)]
            print(f"B={B} {name:6s} PDL {'on ' if on else 'off'}: split {med[0]:.1f} us, combine {med[1]:.1f}, "
                  f"gap split->combine {med[2]:.1f}, call (split start -> combine end) {med[3]:.1f}, "
                  f"gap combine->next split {st.median(nxt):.1f}  (n={len(rows)}, kernels {len(ev)})", flush=True)
