"""Wheels for the GPU machine's image (Python 3.12, no package registry reachable): the
distributions named and everything they require, at the versions installed HERE (the
pinned, tested set of .ci/constraints.txt), less what the image already holds
(gpu_image_packages.txt). `gpu_compare.sh prep-lm-eval` uses it for lm-eval.

    python suites/bench/gpu_wheels.py lm_eval pytz --out .gpul

A distribution with no wheel for that Python and platform (a pure-Python sdist) is built
into a wheel here. Prints each name, version and where its wheel came from; exits 1 naming
any that could not be had.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE = Path(__file__).with_name("gpu_image_packages.txt")
# the image's interpreter and platforms (the `run` tool's README, "a Python package missing there")
TARGET = ["--python-version", "3.12", "--implementation", "cp"] + [
    a for n in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                "manylinux1_x86_64") for a in ("--platform", n)]


def image_packages(path: Path = IMAGE) -> set[str]:
    """Canonical names the image holds (the file's comma- or line-separated list; # comments)."""
    text = "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())
    return {canonicalize_name(n.strip()) for n in text.replace(",", "\n").split() if n.strip()}


def closure(names) -> dict[str, str]:
    """{canonical name: installed version} of `names` and all they require (extras left
    out), as installed in this interpreter. A requirement not installed here is an error:
    its version would be a guess."""
    seen: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_wheels: {name} is not installed here (bash .ci/setup installs the pinned set)")
        seen[name] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
                todo.append(req.name)
    return seen


def fetch(name: str, version: str, out: Path) -> str:
    """The wheel of name==version for the image into out: downloaded, else built from its
    sdist here (pure Python only). Returns how."""
    pip = [sys.executable, "-m", "pip", "-q"]
    spec = f"{name}=={version}"
    got = subprocess.run(pip + ["download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(out), spec],
                         capture_output=True, text=True)
    if got.returncode == 0:
        return "wheel"
    built = subprocess.run(pip + ["wheel", "--no-deps", "--no-binary", name, "-w", str(out), spec],
                           capture_output=True, text=True)
    if built.returncode != 0:
        return "FAILED: " + (got.stderr.strip().splitlines() or ["?"])[-1]
    wheels = list(out.glob(f"{name.replace('-', '_')}-{version}-*.whl")) + list(out.glob(f"{name}-{version}-*.whl"))
    if wheels and not all(w.name.endswith("-none-any.whl") for w in wheels):
        for w in wheels:
            w.unlink()
        return "FAILED: only a platform wheel for this machine's Python could be built"
    return "built from its sdist (pure Python)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--image", type=Path, default=IMAGE)
    a = p.parse_args(argv)
    have = image_packages(a.image)
    a.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, version in sorted(closure(a.names).items()):
        if name in have:
            continue
        how = fetch(name, version, a.out)
        print(f"{name}=={version}: {how}", flush=True)
        if how.startswith("FAILED"):
            failed.append(name)
    size = sum(f.stat().st_size for f in a.out.glob("*.whl")) / 2**20
    print(f"{len(list(a.out.glob('*.whl')))} wheels, {size:.1f} MiB in {a.out}")
    if failed:
        print("gpu_wheels: could not get " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
