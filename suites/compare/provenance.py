"""What produced a compare's figures: kvqbench's version and git commit, each plugin's
distribution and version, the software versions and the hardware. results.json records
them, and resume (results.stamp_matches) compares each row's stamp with what runs now."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch


def kvqbench_version() -> dict:
    """The installed kvqbench's version, and the git commit of the checkout it runs from
    (with `dirty` when tracked files differ from it; None outside a git checkout)."""
    import importlib.metadata
    import subprocess

    try:
        version = importlib.metadata.version("kvqbench")
    except importlib.metadata.PackageNotFoundError:
        version = None
    root = Path(__file__).resolve().parents[2]
    commit = dirty = None
    if os.environ.get("KVQBENCH_COMMIT"):  # a copy whose .git is not its own (the GPU machine's working-tree
        # copy kept a stale .git: results there named an older commit, dirty): the caller names the commit
        return {"version": version, "commit": os.environ["KVQBENCH_COMMIT"], "dirty": None}
    try:
        git = ["git", "-C", str(root)]
        if (root / ".git").exists():
            commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                    check=True).stdout.strip() or None
            dirty = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                        text=True, timeout=10, check=True).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    return {"version": version, "commit": commit, "dirty": dirty}


def plugin_versions() -> dict:
    """quantizer name -> the distribution that ships it and its version (built-ins:
    kvqbench's own)."""
    import importlib.metadata

    from ...quantizers import ENTRY_POINT_GROUP, registry

    out, own = {}, kvqbench_version()["version"]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        if dist is not None:
            out[ep.name] = {"distribution": dist.metadata["Name"], "version": dist.version}
    for name, cls in registry().items():
        if name not in out and cls.__module__.startswith("kvqbench."):
            out[name] = {"distribution": "kvqbench", "version": own}
    return dict(sorted(out.items()))


def _plugin_dist(cls, eps, own: str | None) -> dict | None:
    """The distribution that ships quantizer class `cls`, and its version: the entry point
    naming it, else the distribution holding its top-level package; built-ins: kvqbench."""
    import importlib.metadata

    for ep in eps:
        if (ep.module, ep.attr) == (cls.__module__, cls.__qualname__) and getattr(ep, "dist", None) is not None:
            return {"distribution": ep.dist.metadata["Name"], "version": ep.dist.version}
    if cls.__module__.startswith("kvqbench."):
        return {"distribution": "kvqbench", "version": own}
    for name in importlib.metadata.packages_distributions().get(cls.__module__.split(".")[0], [])[:1]:
        return {"distribution": name, "version": importlib.metadata.version(name)}
    return None


def row_stamps(specs: list[str]) -> dict[str, dict]:
    """spec -> what its records carry and resume compares (results.stamp_matches): the
    quantizer class and its config as resolved now (a changed plugin default changes it),
    kvqbench's version and commit, and the plugin's distribution version."""
    import dataclasses
    import importlib.metadata

    from ...quantizers import ENTRY_POINT_GROUP, get_quantizer

    code, eps = kvqbench_version(), list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    out = {}
    for spec in specs:
        q = get_quantizer(spec)
        cls = type(q)
        # JSON round trip: the dict compares equal to what results.json gives back.
        config = json.loads(json.dumps(dataclasses.asdict(q.config), sort_keys=True, default=str))
        out[spec] = {"quantizer": {"class": f"{cls.__module__}.{cls.__qualname__}", "config": config},
                     "versions": {"kvqbench": code["version"], "commit": code["commit"], "dirty": code["dirty"],
                                  "plugin": _plugin_dist(cls, eps, code["version"])}}
    return out


def versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "kvqbench": kvqbench_version(), "plugins": plugin_versions()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: str) -> dict:
    # the CPU's model and the vector ISA torch's kernels use: quantized rows' PPL moves by a few
    # percent between CPUs (another reduction order flips rounding decisions), so a CPU figure
    # names the arithmetic it came from
    cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    hw = {"platform": platform.platform(), "cpu": cpu_model(), "cpu_capability": cap,
          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device}
    if device.startswith("cuda"):
        hw["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return hw
