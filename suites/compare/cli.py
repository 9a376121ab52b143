"""The `kvqbench` command: `list` the quantizers, `compare` them on a real model."""
from __future__ import annotations

import argparse
import sys


def reference_bits(spec: str, head_dim: int, tokens: int = 2048, heads: int = 8) -> tuple[float, float]:
    """(measured, formula) bits per element of `spec` on a seeded Gaussian reference
    tensor [1, heads, tokens, head_dim] (keys, layer 0, seed 0)."""
    from ...quantizers import get_quantizer
    from ..conformance import reference_tensor

    q = get_quantizer(spec)
    x = reference_tensor(head_dim, tokens=tokens, heads=heads, batch=1, seed=0)
    return q.encode(x).bits_per_element, q.formula_bits(head_dim)


def cmd_list(args) -> int:
    from ...quantizers import registry

    dims = (64, 128)
    print(f"bits per element measured from stored bytes on a reference tensor "
          f"[1, 8, {args.tokens}, d] (keys, seed 0); formula in parentheses\n")
    print(f"{'spec':34s} " + " ".join(f"{'d=' + str(d):>16s}" for d in dims))
    for name, cls in sorted(registry().items()):
        if args.names and name not in args.names:
            continue
        print(f"\n{name}: {cls.description}  [{cls.__module__}]")
        for spec in cls.examples():
            cells = []
            for d in dims:
                try:
                    m, f = reference_bits(spec, d, tokens=args.tokens)
                    cells.append(f"{m:7.3f} ({f:6.3f})")
                except ValueError as e:  # e.g. a group that does not divide d
                    cells.append(f"{'n/a':>16s}")
                    print(f"  note: {spec} at d={d}: {e}", file=sys.stderr)
            print(f"  {spec:32s} " + " ".join(f"{c:>16s}" for c in cells), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvqbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="every registered quantizer with its measured bits per element")
    p.add_argument("names", nargs="*", help="only these quantizers (default: all)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the reference tensor")
    p.set_defaults(func=cmd_list)
    from . import run as compare

    compare.add_arguments(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
