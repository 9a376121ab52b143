"""Packages found from the tree, so the file tree is the package tree: every folder
under the three roots (data folders such as kernels/cuda included, as namespace
packages; the tests are not installed), under the one import root `kvqbench`
(pyproject.toml maps each root and holds everything else). pyproject's
`packages.find` cannot put a prefix on what it finds, hence this file."""
from setuptools import find_namespace_packages, setup

ROOTS = ("quantizers", "kernels", "suites")
found = find_namespace_packages(include=[f"{r}*" for r in ROOTS], exclude=["*__pycache__*", "suites.tests*"])
setup(packages=[f"kvqbench.{p}" for p in found])
