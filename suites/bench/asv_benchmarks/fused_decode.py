"""Fused decode attention over packed caches (kvqbench.kernels) at issue 10's shape:
Llama-3-8B attention (32 query heads, 8 kv heads, head_dim 128), batch 8, 32768
cached tokens, fp16 queries; one decode step, timed with a CUDA sync. Beside it,
fp16 K/V through torch SDPA (the uncompressed baseline), and their ratio as issue 28
reads it (`FusedOverFp16`: both as CUDA-graph replays, one process, at head_dim 64, 128 and 256:
issue 28 asks d 64 and 256 within 0.9x of d 128's ratio). The packed caches are a
real encoding of 4096 tokens tiled to the shape, so setup stays quick. Data and tiling
are the benchmark toolkit's (`synthetic_kv`: keys with three 25x outlier channels, as
the latency suite's; `tile_to`), read from the checkout (common.toolkit).

Skipped (NotImplementedError in setup) without a CUDA GPU, or where the installed
kvqbench has no fused kernels (older commits, no Triton).
"""
from __future__ import annotations

import torch

from .common import fused_specs, toolkit

B, HQ, HKV, T, D = 8, 32, 8, 32768, 128
HEAD_DIMS = [64, 128, 256]  # the ratio's: every head size the embedded models use (SmolLM2 / Qwen 64, Gemma-3 256)
T0 = 4096  # tokens actually encoded; tiled to T
SPECS = fused_specs()  # every fused format's benchmark specs (kernels/formats/, and installed plugins')


def _need_gpu():
    if not torch.cuda.is_available():
        raise NotImplementedError("needs a CUDA GPU")


def _fused_setup(self, spec, d=D):
    """self.q, self.kf, self.vf, self.fn: the packed caches of `spec` at the shape (head_dim d), compiled."""
    _need_gpu()
    try:
        from kvqbench.kernels.decode_attention import decode_attention
        from kvqbench.kernels.layout import flatten
        from kvqbench.quantizers import get_quantizer
    except ImportError as e:  # no kernels at this commit, or no triton
        raise NotImplementedError(f"fused kernels unavailable: {e}") from e
    tk = toolkit()
    k, v = tk.synthetic_kv(1, HKV, T0, d, "cuda")
    kw = {"table_mode": "codebook", "table_dtype": torch.float16} if spec.startswith("hqmq") else {}
    try:
        qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
        kf, vf = flatten(qk.encode(k), "K", **kw), flatten(qv.encode(v), "V", **kw)
        self.kf, self.vf = tk.tile_to(kf, B, T), tk.tile_to(vf, B, T)
    except (ValueError, TypeError) as e:
        raise NotImplementedError(f"{spec}: no fused kernel here: {e}") from e
    self.q = torch.randn(B, HQ, 1, d, generator=torch.Generator().manual_seed(1)).half().cuda()
    self.fn = decode_attention
    self.fn(self.q, self.kf, self.vf)  # compile / autotune outside the timing
    torch.cuda.synchronize()


class FusedDecode:
    params = [SPECS]
    param_names = ["spec"]
    timeout = 600
    setup = _fused_setup

    def time_fused_decode(self, spec):
        self.fn(self.q, self.kf, self.vf)
        torch.cuda.synchronize()


class SdpaFp16:
    """The baseline at the same shape: fp16 K/V, torch SDPA with native GQA."""

    timeout = 300

    def setup(self):
        _need_gpu()
        import torch.nn.functional as F

        self.k, self.v = toolkit().synthetic_kv(B, HKV, T, D, "cuda")
        self.q = torch.randn(B, HQ, 1, D, device="cuda").half()
        self.F = F
        self.F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)
        torch.cuda.synchronize()

    def time_sdpa_decode(self):
        self.F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)
        torch.cuda.synchronize()


class FusedOverFp16:
    """Issue 28's figure as asv tracks it: a fused call's time over fp16 SDPA's at the same
    shape, both replayed as CUDA graphs (host time out), measured in one process so the
    ratio is like with like. Lower is better, so asv flags a rise as it flags a slower time."""

    params = [SPECS, HEAD_DIMS]
    param_names = ["spec", "head_dim"]
    unit = "x fp16 SDPA time"
    timeout = 900

    def setup(self, spec, head_dim):
        _fused_setup(self, spec, head_dim)
        import torch.nn.functional as F

        k, v = toolkit().synthetic_kv(B, HKV, T, head_dim, "cuda")
        self.sdpa = lambda: F.scaled_dot_product_attention(self.q, k, v, enable_gqa=True)

    def track_time_over_fp16_sdpa(self, spec, head_dim):
        tk = toolkit()
        fused = tk.timeit_us(tk.graph_replay(lambda: self.fn(self.q, self.kf, self.vf)))
        return fused / tk.timeit_us(tk.graph_replay(self.sdpa))
