"""The CUDA C++ backend: hand-written decode-attention kernels built with nvcc at first use
and called through ctypes (no torch headers, no extension module).

- `library.py`: the build and load machinery (`KernelLibrary`: nvcc once per machine,
  the library loaded once per process at first use; nothing runs at import);
- `decode_attention.py`: int4 g32, fp8 and KIVI-2/4 over `decode_attention.cu` (one
  kernel template, a decode functor per format);
- `hqmq_decode.py`: HQMQ incl. Med3x over `hqmq_decode.cu`;
- `common.cuh`: what both sources include.

This backend imports neither the front (kernels/decode_attention.py) nor the Triton
backend; the formats (kernels/formats/) register its entry points with the rule each
takes a call by (`unsupported`, `why_unavailable`, and the GPU-verified switches
`decode_attention.CUDA_VERIFIED`, `hqmq_decode.AUTO` / `AUTO_MED3`).
"""
