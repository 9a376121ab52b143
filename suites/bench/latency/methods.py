"""The decode-step attention calls being timed, each built once per shape:

- `fp16-sdpa`: fp16 K/V through torch SDPA (flash backend with native GQA when it
  runs here, else torch's default, said so in the row);
- `fused-<x>`: what ships: `decode_attention(q, k, v)` with backend="auto" and no
  options (the CUDA C++ kernel where the dispatcher routes the format, with its
  default config, else Triton with its defaults); `auto_backend` says which ran
  and why not CUDA (the front's `explain_backend`: the same rules, not a copy);
- `fused-<x>-triton`: the Triton kernel (backend="triton") with a launch config
  (block/warps/stages, splits, HQMQ's codeword table), the tuner's at the focus;
- `fused-<x>-cuda`: the CUDA kernel by opt-in (backend="cuda") where the auto
  route does not take it although it could run (Med3x behind hqmq_decode.AUTO_MED3);
- `fake-quant`: what the public benchmark compared against: the whole packed
  HQMQ cache decoded to fp16 by the quantizer's torch decode, then the same SDPA;
- `flashinfer-fp16`, `flashinfer-fp8` (and `-tc`: its tensor-core kernel): FlashInfer's batch decode over paged fp16 / fp8
  K/V, the kernel serving engines ship, as a peer row where flashinfer is installed
  (skipped with the reason elsewhere).

The toolkit's `graph_replay` captures any of them in a CUDA graph: at B=1 an eager
call costs host time comparable to the kernel, so B=1 is also timed as graph replays.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....kernels import registry
from ....kernels.decode_attention import decode_attention, explain_backend
from ..toolkit import DEVICE, GPU
from .caches import EncodedCache, hqmq_segment

# HQMQ codeword sources (layout.HQMQFlat.with_table): secondaries + arithmetic, or the full codebook
TABLES = {"sec32": ("secondaries", torch.float32), "sec16": ("secondaries", torch.float16),
          "cb32": ("codebook", torch.float32), "cb16": ("codebook", torch.float16)}


def run_sdpa(q, k, v, backend: str):
    if backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


_SDPA_BACKEND: dict = {}


def sdpa_backend() -> tuple[str, list[str]]:
    """The flash backend with native GQA if it runs here, else torch's default, and why
    flash was refused (found once per process)."""
    if not _SDPA_BACKEND:
        q = torch.randn(1, 4, 1, 64, device=DEVICE, dtype=torch.float16)
        k = torch.randn(1, 2, 256, 64, device=DEVICE, dtype=torch.float16)
        errors = []
        if GPU:
            try:
                run_sdpa(q, k, k, "flash")
                _SDPA_BACKEND.update(name="flash", errors=errors)
            except RuntimeError as e:  # "No available kernel" on GPUs or builds without flash
                errors.append(f"flash: {type(e).__name__}: {str(e)[:200]}")
        if not _SDPA_BACKEND:
            run_sdpa(q, k, k, "default")
            _SDPA_BACKEND.update(name="default", errors=errors)
    return _SDPA_BACKEND["name"], _SDPA_BACKEND["errors"]


def sdpa_callable(q, k, v):
    """(call, backend name, why flash was refused)."""
    backend, errors = sdpa_backend()
    return (lambda: run_sdpa(q, k, v, backend)), backend, errors


def fused_callable(q, kf, vf, launch: dict):
    """The Triton call with a launch config: decode_attention's keywords (block_t,
    num_warps, num_stages, programs_per_sm, ...), plus `table` (HQMQ: one of TABLES,
    the codeword source the kernel gathers from). backend="triton" explicitly: an
    empty config would otherwise be routed to CUDA."""
    launch = dict(launch)
    table = launch.pop("table", None)
    if table:
        mode, dtype = TABLES[table]
        kf, vf = kf.with_table(mode, dtype), vf.with_table(mode, dtype)
    return lambda: decode_attention(q, kf, vf, backend="triton", **launch)


def shipped_callable(q, kf, vf, backend: str = "auto", row_start=None):
    """decode_attention as a caller uses it: no launch options (each backend's defaults);
    row_start: a left-padded batch's first keys (`padded_starts`), or None."""
    if row_start is None:
        return lambda: decode_attention(q, kf, vf, backend=backend)
    return lambda: decode_attention(q, kf, vf, backend=backend, row_start=row_start)


def padded_starts(B: int, T: int, device) -> torch.Tensor:
    """The latency suite's left-padded batch: row b's keys from b T / 32 on (B=8, T=32k: 0,
    1k, .., 7k; 11% of the tokens pads), what prompts of different lengths give a batch."""
    return (torch.arange(B, device=device, dtype=torch.int32) * (T // 32)).clamp_max(T - 1)


def auto_backend(q, kf, vf, row_start=None) -> tuple[str, str | None]:
    """(the backend decode_attention(q, kf, vf[, row_start]) runs without options, why not
    CUDA): the front's `explain_backend` (its rules, not a copy). Rows measured on a GPU also
    check the answer against the outputs (`same_output_as_backend`)."""
    route = explain_backend(q, kf, vf, row_start=row_start)
    return route.backend, route.declined.get("cuda")


def cuda_refusal(q, kf, vf) -> str | None:
    """Why backend="cuda" cannot run this call here (None: it can): the format has no CUDA
    kernel, its library does not build or load here (no CUDA device, no nvcc, ...), or the
    kernel does not take the layout (the kernel's own answers, kernels/registry.py)."""
    fmt = registry.format_of_flat(type(kf))
    kernel = fmt.by_backend.get("cuda") if fmt is not None else None
    if kernel is None:
        return f"no CUDA kernel for {type(kf).__name__}"
    return kernel.refusal(q, kf, vf)


def fake_quant_callable(q, cache: EncodedCache, kf, vf):
    """Decode the whole tiled HQMQ cache with the quantizer's torch decode, then SDPA
    (the same backend as the fp16 baseline)."""
    shape = (kf.B, kf.H, kf.T, kf.D)
    sk, sv = hqmq_segment(kf), hqmq_segment(vf)
    backend, _ = sdpa_backend()

    def fn():
        kh = cache.qk.decode_tokens(sk, cache.pk.shared, shape).to(torch.float16)
        vh = cache.qv.decode_tokens(sv, cache.pv.shared, shape).to(torch.float16)
        return run_sdpa(q, kh, vh, backend)

    return fn


# ---------------------------------------------------------------------------------------
# FlashInfer's batch decode (issue 28): the kernel engines ship, as a peer row. K/V in its
# paged layout, HND, PAGE tokens per page, each row's pages consecutive: the same tokens
# as the fp16 SDPA row's [B, Hkv, T, d] (the paging is a copy made before timing).
# ---------------------------------------------------------------------------------------
FLASHINFER_PAGE = 16
# row -> (K/V dtype, use_tensor_cores): FlashInfer's decode has two kernels, CUDA-core and
# tensor-core (its prefill kernel on one query row; vLLM picks it for larger GQA groups),
# and which is faster depends on the group and the card: both are timed, the peer is the
# faster one of each dtype
FLASHINFER_ROWS = {"flashinfer-fp16": (torch.float16, False), "flashinfer-fp16-tc": (torch.float16, True),
                   "flashinfer-fp8": (torch.float8_e4m3fn, False), "flashinfer-fp8-tc": (torch.float8_e4m3fn, True)}


def flashinfer_refusal(B: int, T: int) -> str | None:
    """Why the FlashInfer rows cannot run here (None: they can)."""
    if not GPU:
        return "not run here: FlashInfer's kernels need a CUDA GPU"
    if T % FLASHINFER_PAGE:
        return f"T={T} is not a whole number of {FLASHINFER_PAGE}-token pages"
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return f"not run here: flashinfer is not installed (pip install flashinfer-python on a GPU runner): {e}"
    return None


def paged(x: torch.Tensor, page: int = FLASHINFER_PAGE) -> torch.Tensor:
    """[B, H, T, d] -> FlashInfer's HND pages [B * T / page, H, page, d], row b's pages
    b * T / page onwards (contiguous: a copy)."""
    B, H, T, d = x.shape
    return x.view(B, H, T // page, page, d).permute(0, 2, 1, 3, 4).reshape(B * T // page, H, page, d).contiguous()


def page_table(B: int, T: int, device, page: int = FLASHINFER_PAGE):
    """(indptr [B + 1], indices [B * T / page], last_page_len [B]): int32, every page full."""
    n = T // page
    indptr = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=device)
    indices = torch.arange(B * n, dtype=torch.int32, device=device)
    return indptr, indices, torch.full((B,), page, dtype=torch.int32, device=device)


def flashinfer_callable(q, k16, v16, kv_dtype, tensor_cores: bool = False, flashinfer=None):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper over k16 / v16 ([B, Hkv, T, d]) held
    as `kv_dtype` (fp16, or e4m3 with unit scales, as vLLM's fp8 cache without scales),
    with its tensor-core kernel or not, planned once; the call is `run` alone.
    `flashinfer`: the module (tests pass a stand-in)."""
    if flashinfer is None:
        import flashinfer
    B, Hkv, T, d = k16.shape
    kp, vp = paged(k16).to(kv_dtype), paged(v16).to(kv_dtype)
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=tensor_cores)
    wrapper.plan(*page_table(B, T, q.device), q.shape[1], Hkv, d, FLASHINFER_PAGE, pos_encoding_mode="NONE",
                 q_data_type=q.dtype, kv_data_type=kv_dtype)
    q3 = q.reshape(B, q.shape[1], d)
    return lambda: wrapper.run(q3, (kp, vp)).view(B, -1, 1, d)
