"""`kvqbench-lm-eval` (also `python -m kvqbench.suites.lm_eval.cli`): lm-eval's own
command line with `--model kvqbench` registered (importing `model` registers it) and
the offline tasks on `--include_path`."""
from __future__ import annotations

import sys

from . import model  # noqa: F401  (registers the `kvqbench` model with lm-eval)


def main(argv=None) -> int:
    """`kvqbench-lm-eval`: lm-eval's command line with `--model kvqbench` registered and
    the offline tasks on `--include_path` (unless one is given)."""
    from lm_eval.__main__ import cli_evaluate

    from .tasks import TASKS_DIR

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not any(a in ("-h", "--help") for a in args) \
            and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    saved = sys.argv
    sys.argv = ["kvqbench-lm-eval"] + args
    try:
        cli_evaluate()
    except model.ModelArgsError as e:  # the user's model_args: the message is the help, a traceback is noise
        print(f"kvqbench-lm-eval: error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
