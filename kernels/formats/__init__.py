"""The fused formats, one file per format: each defines `FORMAT`, a `kernels.registry.Format`
(its Flat type and flatten, its store fields or store class, its device step encoder, its
kernels per backend). kernels/registry.py finds every module here on first use; an
installed package adds formats through the `kvqbench.formats` entry point group.
kernels/FORMATS.md walks through adding one.
"""
