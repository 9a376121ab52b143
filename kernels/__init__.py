"""kvqbench.kernels: fused decode attention and device encoders over packed caches.

This folder is only ever meant to be imported as `kvqbench.kernels`. Where the
repository root is on sys.path (`python -m` or `python -c` from the root,
torchrun, a notebook started there), a plain `import kernels` finds it first,
and transformers imports Hugging Face's kernel hub under that very name. So,
imported as the top-level `kernels`, this module steps aside: it loads the
next `kernels` on sys.path (HF's) in its place; with none installed it stays an
empty module without a version, which transformers reads as "not installed".
"""
if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _step_aside() -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        others = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", others)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        # The import system returns whatever sys.modules holds once this file has run.
        sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["kernels"]
            raise

    _step_aside()
    del _step_aside
