"""The `kvqbench` command: `list` the quantizers, `compare` them on a real model,
`report` a finished run again from its records, `generate` text through a quantized
cache at engine speed.

Exit status: 0 success; 1 an error the run could not get past (one line; the
traceback with --debug); 2 bad usage (argparse's own checks and ours, all made
before any model work); 3 `compare` wrote its report but some configuration
failed; 130 interrupted (Ctrl-C; what was measured is kept, a rerun resumes).
"""
from __future__ import annotations

import argparse
import sys
import traceback

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


LIST_HEADS = 8  # kv-heads of `kvqbench list`'s reference tensor


def reference_bits(spec: str, head_dim: int, tokens: int = 2048, heads: int = LIST_HEADS) -> tuple[float, float, int]:
    """(measured cache bits, formula bits, model-constant bytes) of `spec` on a seeded
    Gaussian reference tensor [1, heads, tokens, head_dim] (keys, layer 0, seed 0): the
    cache's own bits per element (quantizers/base.py `Packed.cache_bits_per_element`)
    and the bytes of its model constants for that one (layer, role)."""
    from ...quantizers import get_quantizer
    from ..conformance import reference_tensor

    q = get_quantizer(spec)
    if getattr(q, "needs_calibration", False):  # calibrated once per model: on another seeded tensor
        q.load_calibration(q.calibrate(reference_tensor(head_dim, tokens=min(tokens, 512), heads=heads, batch=1,
                                                        seed=1)))
    x = reference_tensor(head_dim, tokens=tokens, heads=heads, batch=1, seed=0)
    packed = q.encode(x)
    return packed.cache_bits_per_element, q.formula_bits(head_dim), packed.constant_nbytes


def cmd_list(args) -> int:
    from ...quantizers import broken_plugins, names, registry
    from .run import UsageError

    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    unknown = [n for n in args.names if n not in registry()]
    if unknown:
        raise UsageError(f"unknown quantizer(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(registry()))}"
                         + (f" (aliases such as {', '.join(sorted(set(names()) - set(registry()))[:4])} "
                            "are specs, not plugin names)" if set(unknown) & set(names()) else ""))
    dims = (64, 128)
    print(f"cache bits per element measured from stored bytes on a reference tensor [1, {LIST_HEADS}, {args.tokens}, d]"
          " (keys, seed 0);\nformula bits in parentheses; '+N B': bytes of the model constants (seeded rotations, "
          "sketches, secondaries,\ncalibrated codebooks: once per model, not cache bytes) of that one (layer, role) "
          f"of {LIST_HEADS} kv-heads;\na calibrated spec (e.g. avq2-cal) calibrated on another seeded tensor\n")
    print(f"{'spec':34s} " + " ".join(f"{'d=' + str(d):>26s}" for d in dims))
    for name, cls in sorted(registry().items()):
        if args.names and name not in args.names:
            continue
        print(f"\n{name}: {cls.description}  [{cls.__module__}]")
        for spec in (*cls.examples(), *getattr(cls, "calibrated_example_specs", ())):
            cells = []
            for d in dims:
                try:
                    m, f, const = reference_bits(spec, d, tokens=args.tokens)
                    cells.append(f"{m:7.3f} ({f:6.3f}) +{const:>6d} B")
                except ValueError as e:  # e.g. a group that does not divide d
                    cells.append(f"{'n/a':>26s}")
                    print(f"  note: {spec} at d={d}: {e}", file=sys.stderr)
            print(f"  {spec:32s} " + " ".join(f"{c:>26s}" for c in cells), flush=True)
    broken = broken_plugins()
    if broken:
        print("\nplugins that failed to load (left out; every other quantizer works):")
        for b in broken:
            print(f"  {b}")
    return EXIT_OK


def cmd_report(args) -> int:
    """Re-render report.md and the plots of finished `compare` runs from their results.json,
    measuring nothing (a rerun of `compare` after a commit measures its rows again)."""
    from pathlib import Path

    from filelock import FileLock, Timeout

    from . import report
    from .results import LOCK_WAIT_S, RunError
    from .run import UsageError

    for folder in map(Path, args.folders):
        path = folder / "results.json"
        if not path.is_file():
            raise UsageError(f"{folder}: no results.json there (a `kvqbench compare` run folder has one)")
        try:  # never beside a run that is still writing the file
            with FileLock(str(path) + ".lock", timeout=LOCK_WAIT_S):
                out = report.write_report(folder)
        except Timeout:
            raise RunError(f"{path} is being written by a running `kvqbench compare`; wait for it") from None
        except (ValueError, KeyError, TypeError) as e:
            raise RunError(f"{path} is not a readable results file ({type(e).__name__}: {str(e)[:120]})") from None
        print(f"report: {out}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from . import generate_cmd
    from . import run as compare

    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's default must not overwrite `kvqbench --debug compare`.
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show full tracebacks on errors")
    parser = argparse.ArgumentParser(prog="kvqbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="every registered quantizer with its measured cache bits per element and "
                       "model-constant bytes", parents=[common])
    p.add_argument("names", nargs="*", help="only these quantizers (default: all)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the reference tensor")
    p.set_defaults(func=cmd_list)
    compare.add_arguments(sub, parents=[common])
    p = sub.add_parser("report", help="re-render the report and plots of finished compare runs from their "
                       "results.json (measures nothing)", parents=[common])
    p.add_argument("folders", nargs="+", help="run folders (reports/<run>)")
    p.set_defaults(func=cmd_report)
    generate_cmd.add_arguments(sub, parents=[common])
    return parser


def main(argv=None) -> int:
    """Run the command; returns the exit status (an int, never a path)."""
    from .results import RunError
    from .run import UsageError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2), message already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.debug = getattr(args, "debug", False)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (compare --workers relaunches it)
    prog = f"kvqbench {args.command}"
    try:
        return args.func(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; what was measured is saved, the same command resumes", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RunError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # noqa: BLE001 - one line for the user, the traceback on request
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (rerun with --debug for the traceback)"
        print(f"{prog}: error: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
