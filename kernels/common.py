"""What every decode-attention backend shares, below all of them: the checks of a call,
the split choice, the partial-result workspace and the machine facts they read.

Neutral by design (kernels/FORMATS.md, "The house"): the front (`decode_attention.py`),
the Triton backend (`kernels/triton/`) and the CUDA backend (`kernels/cuda/`) import
from here; nothing here imports any of them, and none of them re-exports these names.
No Triton and no CUDA library is touched at import.
"""
from __future__ import annotations

import math
import os
import weakref

import torch


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------
_SM_COUNT: dict = {}
# Multiprocessors to plan for instead of asking the device: a tool that plans launches for
# a GPU it does not have (kernels/aot_check.py) sets it; None asks the device (1 off CUDA).
ASSUMED_SM_COUNT: int | None = None


def sm_count(device) -> int:
    """Streaming multiprocessors of `device` (1 under the interpreter or off CUDA)."""
    if ASSUMED_SM_COUNT is not None:
        return ASSUMED_SM_COUNT
    if interpreting() or device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# ---------------------------------------------------------------------------------------
# split choice
# ---------------------------------------------------------------------------------------
def choose_splits(rows: int, ntiles: int, device, num_splits: int | None = None,
                  programs_per_sm: int = 8) -> tuple[int, int]:
    """(number of splits, tiles per split): about programs_per_sm programs per SM,
    every split non-empty (the Triton kernels' rule)."""
    if ntiles <= 0:
        return 1, 0
    want = num_splits or max(1, math.ceil(programs_per_sm * sm_count(device) / max(1, rows)))
    want = max(1, min(want, ntiles))
    per = math.ceil(ntiles / want)
    return math.ceil(ntiles / per), per


def token_tiles(T: int) -> int:
    """16-token tiles of T tokens (at least one): all of T that `split_tiles` reads, so
    splits made for one T serve every T of the same tile count (the CUDA plans' retarget)."""
    return max(1, -(-T // 16))


def split_tiles(rows: int, T: int, sms: int, num_splits: int | None, ctas_per_sm: int | None, default,
                multiple: int = 1) -> tuple[int, int]:
    """(number of splits, 16-token tiles per split) of T tokens in each of `rows` rows, every
    split non-empty: num_splits if given, else about ctas_per_sm CTAs per SM (of `sms`) if
    given, else `default(tiles)` splits; tiles per split rounded up to a multiple of
    `multiple` (the CUDA HQMQ kernel's Med3x blocks). The CUDA kernels' rule."""
    tiles = token_tiles(T)
    if num_splits:
        want = num_splits
    elif ctas_per_sm:
        want = math.ceil(ctas_per_sm * sms / max(1, rows))
    else:
        want = default(tiles)
    want = max(1, min(want, tiles))
    per = -(-tiles // want)
    per = -(-per // multiple) * multiple
    return -(-tiles // per), per


# ---------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------
def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_q(q: torch.Tensor, H: int, D: int, B: int) -> None:
    """q must be one decode token per sequence, `[B, Hq, 1, D]`, Hq a multiple of H."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, Hq, 1, d] (one decode token), got {tuple(q.shape)}")
    if q.shape[0] != B or q.shape[3] != D or q.shape[1] % H:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of B={B}, Hkv={H}, d={D}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} not supported")
    if not head_dim_ok(D):
        raise ValueError(f"head_dim must be a multiple of 16 up to 256, or a power of two >= 16, got {D}")


def head_dim_ok(D: int) -> bool:
    """The head dims the Triton kernels take: powers of two from 16, and multiples of 16 up
    to 256 (run padded to the next power of two, kernels/triton/common.py `pad_cols`)."""
    return D >= 16 and (D & (D - 1) == 0 or (D % 16 == 0 and D <= 256))


def check_valid_len(valid_len, q: torch.Tensor):
    """(kernel argument, VLEN) for an optional device valid length: an int32 tensor of one
    element on q's device (checked without reading it: a host read would sync and could
    not be captured in a CUDA graph)."""
    if valid_len is None:
        return q, False  # never read (VLEN False): any pointer will do
    if not isinstance(valid_len, torch.Tensor) or valid_len.dtype != torch.int32 or valid_len.numel() != 1:
        raise ValueError("valid_len must be an int32 tensor of one element (the number of valid tokens)")
    if valid_len.device != q.device:
        raise ValueError(f"valid_len is on {valid_len.device}, q on {q.device}")
    return valid_len, True


def check_row_start(row_start, q: torch.Tensor):
    """(kernel argument, RSTART) for optional per-row starts of a left-padded batch: an
    int32 tensor `[B]` on q's device, keys at positions < row_start[b] masked out for
    batch row b (checked without reading it, as `check_valid_len`)."""
    if row_start is None:
        return q, False  # never read (RSTART False): any pointer will do
    if not isinstance(row_start, torch.Tensor):
        raise ValueError(f"row_start must be an int32 tensor [B] (first key position per batch row), got "
                         f"{type(row_start).__name__}")
    if row_start.dtype != torch.int32:
        raise ValueError(f"row_start must be int32 (first key position per batch row), got {row_start.dtype}")
    if tuple(row_start.shape) != (q.shape[0],):
        raise ValueError(f"row_start must have shape [B] = ({q.shape[0]},) (one start per batch row), got "
                         f"{tuple(row_start.shape)}")
    if row_start.device != q.device:
        raise ValueError(f"row_start is on {row_start.device}, q on {q.device}")
    if row_start.stride(0) != 1 and row_start.numel() > 1:
        raise ValueError("row_start must be contiguous")
    return row_start, True


def bh_stride(t: torch.Tensor, name: str = "buffer") -> int:
    """Elements between consecutive (b, h) rows of a `[B, H, cap, ...]` buffer laid out
    as the contract says (a contiguous buffer or a `[:, :, :n]` view of one)."""
    inner = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size > 1 and stride != inner:
            raise ValueError(f"{name}: the token row must be contiguous, got strides {t.stride()}")
        inner *= size
    if t.shape[1] > 1 and t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        raise ValueError(f"{name}: batch stride {t.stride(0)} != H * head stride {t.stride(1)}")
    if t.stride(1) < inner:
        raise ValueError(f"{name}: head stride {t.stride(1)} shorter than the valid rows")
    return t.stride(1)


# ---------------------------------------------------------------------------------------
# launch plans kept per layout (both backends: what a call derives from the shapes, once)
# ---------------------------------------------------------------------------------------
class PlanCache:
    """Launch plans by call key. A plan serves while every tensor it points into is alive: the
    key must hold those tensors' identities (quantizers/derived.py `identity`: id() without
    its audit) and every int, dtype, option and q property the plan derives from (anything
    else that changes then makes a new key). `put` keeps a weak reference to each tensor
    whose callback drops the entry when the tensor is freed, which CPython does before its
    address can be handed to another object: so a key found is a key of
    live tensors, the very objects the plan was made from, and `get` is one dict lookup (it
    compared each tensor by identity before: an HQMQ call's 16 tensors; a decode_attention
    call through the CUDA path walked on a 2-core CPU, B=1, T=4096, same-run A/B: HQMQ 12.9 ->
    11.4 us, int4 11.2 -> 10.5, 2026-12-06). A tensor resized or restrided IN PLACE keeps
    its id: the decode store never does that (it grows into new buffers). Cleared when
    `limit` plans are held: a plan is cheap to make again. `builds` counts the plans put
    (tests).

    In front of the dict, a memo on the K flat (`memo_get` / `memo_put`): the plan of its
    last call, valid while both flats keep their `stamp` (kernels/layout.py `Stamped`: any
    field set but the token counts renews it) and the call's other facts (q's shape, dtype
    and device, the options) are equal, and this cache has not been cleared since. It saves
    building the key (an HQMQ call reads 16 tensors and 18 fields for it) on every eager
    decode step after a layout's first; the flats hold the tensors the plan points into."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.plans: dict = {}
        self.builds = 0
        self.generation = 0  # renewed by every clear: a memo of an older one is void

    def memo_get(self, k, v, facts):
        """The plan `memo_put` left on flat k for this v and these facts, None if void."""
        m = k._plan_memo
        if (m is not None and m[0] is self and m[2] is v and m[1] == self.generation
                and m[3] == k.stamp and m[4] == v.stamp and m[5] == facts):
            return m[6]
        return None

    def memo_put(self, k, v, facts, plan):
        """Leave plan (kept here under the full key) on flat k for `memo_get`; returns it."""
        k._plan_memo = (self, self.generation, v, k.stamp, v.stamp, facts, plan)
        return plan

    def find(self, k, v, facts, lookup, *args):
        """The plan kept for a call on flats (k, v) with these facts, None if none: the memo,
        else `lookup(*args)[0]` (the backend's full-key lookup), then memoised."""
        plan = self.memo_get(k, v, facts)
        if plan is None:
            plan = lookup(*args)[0]
            if plan is not None:
                self.memo_put(k, v, facts, plan)
        return plan

    def get(self, key):
        """The plan kept under key (its tensors are alive: the ones whose ids the key holds), None
        when there is none."""
        entry = self.plans.get(key)
        return None if entry is None else entry[1]

    def put(self, key, tensors, plan):
        """Keep plan under key (tensors: the ones it points into, None where absent); returns it."""
        if len(self.plans) >= self.limit:
            self.clear()
        plans = self.plans

        def drop(_ref, key=key):  # a tensor of the entry is being freed: its id may be reused
            entry = plans.get(key)
            if entry is not None and any(r is _ref for r in entry[0]):
                del plans[key]

        # (the weak references live in the entry: an entry dropped or replaced takes its
        # callbacks with it, so a callback only ever drops the entry it belongs to)
        self.plans[key] = (tuple(weakref.ref(t, drop) for t in tensors if t is not None), plan)
        self.builds += 1
        return plan

    def clear(self) -> None:
        self.plans.clear()
        self.generation += 1


# ---------------------------------------------------------------------------------------
# partial results
# ---------------------------------------------------------------------------------------
class Workspace:
    """Partial-result buffers for one shape, reused between calls (and by CUDA graphs)."""

    def __init__(self, rows_q, nsplit, D, device, out_dtype=torch.float32):
        self.nsplit = nsplit
        self.po = torch.empty(rows_q * nsplit * D, dtype=torch.float32, device=device)
        self.pm = torch.empty(rows_q * nsplit, dtype=torch.float32, device=device)
        self.pl = torch.empty(rows_q * nsplit, dtype=torch.float32, device=device)
        self.out = torch.empty(rows_q * D, dtype=out_dtype, device=device)


__all__ = ["PlanCache", "interpreting", "sm_count", "ASSUMED_SM_COUNT", "choose_splits", "split_tiles", "pow2",
           "head_dim_ok", "check_q",
           "check_valid_len", "check_row_start", "bh_stride", "Workspace"]
