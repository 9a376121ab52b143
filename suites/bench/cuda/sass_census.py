"""Instruction census of a CUDA kernel's loops, read from its SASS on the CPU machine (no
GPU): how many instructions one trip of each loop issues, by opcode. A design's cost in
instructions can be read before any device time is spent (issue 28's kernels are bound by
their instruction chains on the H200: an int4 tile at d 128 is 418 instructions, 225 of them
the nibble decode; reports/kernels/NOTES.md, twentieth session).

    python -m kvqbench.suites.bench.gpu_prebuild          # the libraries, into .gpubuild/
    python -m kvqbench.suites.bench.cuda.sass_census .gpubuild/kvqbench_cuda_decode/kvq_decode_sm90_*.so --list
    python -m kvqbench.suites.bench.cuda.sass_census LIB.so "split_kernel<(anonymous namespace)::Int4<128>, 128, 4, 1, 1, 4, 0, false>"

`--against OLD.so` instead compares two builds kernel by kernel (opcodes and operands, by
demangled name): which instances a change left byte-identical, which it moved, which are
new or gone; a template parameter with a default appended to a kernel (", 1>" at the end of
its arguments) is matched to the name without it. A kernel change whose other instances
stay identical needs no new GPU run for them.

The kernel is named by a substring of its demangled name (`--list` prints them), which must
match one kernel. A loop is a predicated backward branch; its trip is every instruction
from the branch's target to the branch, conditional blocks inside included (each is listed with its
length, e.g. the softmax's lazy rescale, which most trips skip). Uses the cuobjdump that
ships inside Triton's package and c++filt.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter

from ....kernels.aot_check import cuobjdump

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def functions(sass: str) -> dict[str, list[tuple[int, str, str, bool]]]:
    """{mangled name: [(address, opcode, operands, predicated)]} of cuobjdump -sass text."""
    out, cur = {}, None
    for line in sass.splitlines():
        if "Function : " in line:
            cur = out.setdefault(line.split("Function : ", 1)[1].strip(), [])
        elif cur is not None and (m := _INSTR.search(line)):
            cur.append((int(m.group(1), 16), m.group(3), m.group(4).strip(), bool(m.group(2))))
    return out


def demangle(names: list[str]) -> dict[str, str]:
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, r.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def _branch_target(op: str, args: str) -> int | None:
    """The address a BRA jumps to, None for any other instruction."""
    t = _TARGET.search(args) if op == "BRA" else None
    return int(t.group(1), 16) if t else None


def loops(code: list[tuple[int, str, str, bool]]) -> list[dict]:
    """Each predicated backward branch as a loop: its span, trip length, opcodes and the forward
    branches inside it (conditional blocks: their length)."""
    found = []
    for end, op, args, pred in code:
        lo = _branch_target(op, args)
        # a loop closes with a predicated branch back; an unpredicated one is out-of-line code
        # (a divergent collective's fallback) returning into the body
        if lo is None or not pred or lo >= end:
            continue
        body = [x for x in code if lo <= x[0] <= end]
        skips = []
        for b, bop, bargs, bpred in body:
            t = _branch_target(bop, bargs)
            if t is not None and bpred and b < t <= end:
                skips.append((b, t, sum(1 for x in body if b < x[0] < t)))
        found.append({"start": lo, "end": end, "count": len(body),
                      "opcodes": Counter(o.split(".")[0] for _, o, _, _ in body), "skips": skips})
    return sorted(found, key=lambda d: -d["count"])


def read(library: str) -> tuple[dict, dict]:
    """({mangled name: code}, {mangled name: demangled name}) of a built library."""
    r = subprocess.run([cuobjdump(), "-sass", library], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {library}: {r.stderr.strip()[:300]}")
    fns = functions(r.stdout)
    return fns, demangle(list(fns))


def compare(old: dict, new: dict) -> dict:
    """Kernels of two builds ({demangled name: code}) by name: identical (opcodes and
    operands), differ, gone, new. A new name ending in an appended default template argument
    (", 1>(") is matched to the old name without it."""
    def text(code):
        return [(op, args) for _, op, args, _ in code]

    norm = {re.sub(r", 1>\(", ">(", n): n for n in new}
    out = {"identical": [], "differ": [], "gone": [], "new": []}
    matched = set()
    for n, code in old.items():
        m = n if n in new else norm.get(n)
        if m is None:
            out["gone"].append(n)
        else:
            matched.add(m)
            out["identical" if text(code) == text(new[m]) else "differ"].append(n)
    out["new"] = [n for n in new if n not in matched]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library", help="a built kernels/cuda library (.so), e.g. from gpu_prebuild")
    ap.add_argument("kernel", nargs="?", default="", help="a substring of the kernel's demangled name")
    ap.add_argument("--list", action="store_true", help="print the kernels' demangled names")
    ap.add_argument("--against", metavar="OLD.so", help="compare every kernel with another build of the library")
    ap.add_argument("--top", type=int, default=24, help="opcodes shown per loop")
    ap.add_argument("--top-blocks", type=int, default=6, help="largest conditional blocks shown per loop")
    a = ap.parse_args(argv)
    try:
        fns, names = read(a.library)
        if a.against:
            ofns, onames = read(a.against)
    except (RuntimeError, OSError) as e:  # (cuobjdump failed, or Triton ships none)
        print(f"sass_census: {e}", file=sys.stderr)
        return 1
    if a.against:
        res = compare({onames[m]: c for m, c in ofns.items()}, {names[m]: c for m, c in fns.items()})
        print(", ".join(f"{k} {len(v)}" for k, v in res.items()) + f" (of {len(ofns)} kernels in {a.against})")
        for k in ("differ", "gone", "new"):
            for n in res[k]:
                print(f"  {k}: {n}")
        return 0
    if a.list or not a.kernel:
        print("\n".join(sorted(names.values())))
        return 0
    hits = [m for m, d in names.items() if a.kernel in d]
    if len(hits) != 1:
        print(f"sass_census: {len(hits)} kernels match {a.kernel!r} (one needed; --list names them)"
              + "".join(f"\n  {names[m]}" for m in hits[:10]), file=sys.stderr)
        return 2
    code = fns[hits[0]]
    print(f"{names[hits[0]]}: {len(code)} instructions")
    for lp in loops(code):
        print(f"loop 0x{lp['start']:x}-0x{lp['end']:x}: {lp['count']} instructions a trip")
        print("  " + ", ".join(f"{op} {n}" for op, n in lp["opcodes"].most_common(a.top)))
        big = sorted(lp["skips"], key=lambda x: -x[2])[:a.top_blocks]
        for b, t, n in sorted(big):
            print(f"  conditional block at 0x{b:x} -> 0x{t:x}: {n} instructions (skipped when its branch is taken)")
        if len(lp["skips"]) > len(big):
            print(f"  ({len(lp['skips']) - len(big)} smaller conditional blocks not shown)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
