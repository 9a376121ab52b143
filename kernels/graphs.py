"""Decode without launch overhead: CUDA graphs of a fused decode kernel and of a model's step.

`GraphedDecode` captures the attention kernel alone over fixed buffers and a fixed
length (kernel benchmarks); `GraphedDecodeStep` captures a whole one-token forward
pass of a model over its cache, valid while the cache grows (decode engines).

GraphedDecode
-------------

At B=1 a decode step moves little data (T=32k: ~20 MB packed, ~5 us at copy
bandwidth) while the Python wrapper, the Triton launcher (two launches: split
kernel and combine) and the allocations cost ~50-150 us of host time: the call
tracks launches, not bytes. Replaying a captured graph costs one graph launch.

    step = GraphedDecode(kf, vf, q_example, block_t=64)   # captures once
    out = step(q)                                          # copies q in, replays, returns out

The graph bakes in the cache's buffers and its valid length T (a kernel argument):
it is valid while those stay the same (a benchmark, or a fixed-capacity cache that is
re-captured when T changes). `out` is the graph's own buffer, overwritten by the next
replay. On machines without CUDA, `GraphedDecode` runs the plain call (no capture).
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from .decode_attention import decode_attention


class GraphedDecode:
    def __init__(self, k, v, q_example: torch.Tensor, **launch):
        self.k, self.v, self.launch = k, v, launch
        self.q = q_example.detach().clone()
        self.graph = None
        if not (self.q.is_cuda and torch.cuda.is_available()):
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for _ in range(2):
                decode_attention(self.q, k, v, **launch)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # the workspace comes from the graph's pool
            self.out = decode_attention(self.q, k, v, **launch)

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if q.shape != self.q.shape or q.dtype != self.q.dtype:
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} differs from the captured "
                             f"{tuple(self.q.shape)} {self.q.dtype}")
        if self.graph is None:
            return decode_attention(q, self.k, self.v, **self.launch)
        self.q.copy_(q)
        self.graph.replay()
        return self.out


class GraphedDecodeStep:
    """One greedy-decode step of a causal LM (one new token per row) over its cache,
    captured in a CUDA graph and replayed while the cache grows.

        cache = QuantizedCache("int4", config=model.config)       # under fused_attention(model)
        model(input_ids=prompt, **cache_kwargs(model, cache))    # the prefill, as usual
        step = GraphedDecodeStep(model, cache, batch=B, max_tokens=prompt_len + new_tokens)
        logits = step(next_ids)    # [B, 1, vocab]: ids copied in, one replay (a buffer of the graph)

    Why it can be captured: a graph bakes in every kernel argument, so nothing that
    changes per step may be a host value. A `QuantizedCache` in `device_steps` keeps
    the number of stored tokens in a device int32 counter: the step encoders write at
    it (kernels/step_encode.py, `pos`), the fused attention reads it as its valid length
    (`decode_attention(valid_len=)`, the grid cut for the `reserve`d capacity), the
    captured step adds 1 to it and to the position ids; buffers are reserved up front so
    none moves. The host side (token counts, the stores' lengths, the Packed views
    behind `bits_per_element`) is advanced after each replay without reading the device
    (`cache.advance(1)`: the host knows it replayed one step). The "kvqbench" mask
    function returns no mask for an unpadded one-token step (attention.py), so no
    host-sized mask is baked in either. A transformers `StaticCache` (its length is a
    device tensor too) is captured as it is: the plain engine baseline.

    Modes (`mode`, with `why` saying why not "graph"):
    - "graph": captured after `warmup` device-position steps run eagerly on a side
      stream (the Triton kernels compile, cuBLAS sets up), then replayed;
    - "device": device-position steps without capture (no CUDA: the CPU interpreter,
      TRITON_INTERPRET=1, runs the same kernels, which the tests use; or a capture
      that failed);
    - "eager": the cache cannot take device-position steps (`graph_unsupported()`:
      a windowed append such as per-channel int keys, a quantizer that syncs, ...; a
      DynamicCache grows by cat): the ordinary forward
      per call. (KIVI is captured: its window flushes are decided on the device from
      the counter, kernels/store.py; its attention runs on Triton, the CUDA KIVI kernel
      taking no device lengths yet.)

    Positions: each step continues the cache (position id = tokens held), as greedy
    `generate` does; a left-padded batch (`QuantizedCache.set_row_start`) has each row's
    tokens held minus its pad count, computed on the device from the counter and the
    row starts inside the step (the attention masks the pads: the cache's handle). A
    write to the cache between calls through the ordinary path is picked up (the
    counter and the position ids are re-set before the next replay, outside the
    graph); anything that moves the cache's buffers (growth past
    the reserved room, `reset`, `replace_packed`) needs a new object: a replay checks
    the buffers' addresses (`QuantizedCache.buffer_signature`) and refuses. Warm-up
    steps are real steps.
    """

    def __init__(self, model, cache, batch: int, *, max_tokens: int | None = None, warmup: int = 2):
        self.model, self.cache, self.batch, self.warmup = model, cache, int(batch), int(warmup)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = {("cache" if "cache" in params else "past_key_values"): cache}
        self.device = next(model.parameters()).device
        self.quantized = hasattr(cache, "device_steps")
        self.graph, self.logits, self.steps = None, None, 0
        self.mode, self.why = "graph", None
        self._signature: tuple | None = None  # the cache's buffer addresses the graph holds
        with torch.inference_mode():
            if self.quantized:
                why = cache.graph_unsupported()
                if why is None:
                    need = max_tokens or getattr(cache, "capacity", 0)
                    if not need or need <= cache.get_seq_length():
                        raise ValueError(f"max_tokens={max_tokens}: give the total tokens to reserve room for "
                                         f"(more than the {cache.get_seq_length()} held)")
                    cache.reserve(need)
                else:
                    self.mode, self.why = "eager", why
            elif not _static_length(cache):
                self.mode, self.why = "eager", (f"{type(cache).__name__} keeps its length on the host or grows its "
                                                "buffers (a StaticCache does not)")
            if self.mode != "eager" and self.device.type != "cuda":
                self.mode, self.why = "device", "no CUDA device: device-position steps run eagerly, uncaptured"
            t = int(cache.get_seq_length())  # (a StaticCache: a device tensor, read once here)
            self.ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
            self.pos = torch.full((self.batch, 1), t, dtype=torch.long, device=self.device)
            self._pos_at = t  # the host token count self.pos holds

    def moved(self) -> bool:
        """Whether the cache's buffers moved since the capture (a replay would refuse): a
        write between calls that outgrew the reserved room (a rewound Med3x cache's next
        prompt: its lists' room is given back after each write, kernels/formats/hqmq.py)."""
        return self.graph is not None and self.quantized and self.cache.buffer_signature() != self._signature

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tuple(input_ids.shape) != (self.batch, 1):
            raise ValueError(f"input_ids must be [{self.batch}, 1] (one new token per row), got {tuple(input_ids.shape)}")
        with torch.inference_mode():
            if self.mode == "eager":  # (a left-padded batch: each row's positions, from the host count)
                rows = self.cache.position_ids(self.cache.get_seq_length(), 1) if self.quantized else None
                extra = {} if rows is None else {"position_ids": rows}
                return self.model(input_ids=input_ids, **self.cache_kw, use_cache=True, **extra).logits
            if self.quantized:
                t = self.cache.get_seq_length()
                if t + 1 > self.cache.reserved:
                    raise RuntimeError(f"the cache holds {t} tokens, the {self.cache.reserved} reserved are used up "
                                       "(a graphed step cannot grow it: build the step with a larger max_tokens)")
                self.cache.device_position()  # re-set outside the graph when a host-path write came between
                if t != self._pos_at:
                    self.pos.fill_(t)
                    self._pos_at = t
            self.ids.copy_(input_ids)
            if self.graph is not None:
                if self.moved():
                    raise RuntimeError("the cache's buffers moved since the step was captured (reset, replace_packed, "
                                       "growth): the graph would write and read freed memory; build a new "
                                       "GraphedDecodeStep")
                self.graph.replay()
                out = self.logits
            elif self.mode == "graph" and self.steps >= self.warmup:
                out = self._capture()
            elif self.mode == "graph":  # warm-up: a real step, eagerly, on a side stream
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    out = self._device_step()
                torch.cuda.current_stream(self.device).wait_stream(side)
            else:
                out = self._device_step()
            if self.quantized:
                self.cache.advance(1)
                self.cache.poll_errors()
            self._pos_at += 1
            self.steps += 1
            return out

    def _device_step(self) -> torch.Tensor:
        """The step as captured: forward at the device position, then the counters + 1."""
        ctx = self.cache.device_steps() if self.quantized else contextlib.nullcontext()
        with ctx:
            # a left-padded batch: the device write position minus each row's start, made on
            # the device inside the step (so a replay follows the counter and the starts a
            # rewound cache was given); else the step's own position buffer
            rows = self.cache.device_position_ids() if self.quantized else None
            out = self.model(input_ids=self.ids, position_ids=self.pos if rows is None else rows, **self.cache_kw,
                             use_cache=True).logits
        if self.quantized:
            self.cache.step_done()
        self.pos.add_(1)
        return out

    def _capture(self) -> torch.Tensor:
        """Capture the step, then replay it once (capturing runs nothing). A failed capture
        leaves the device state as it was (nothing ran): the step then runs uncaptured."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._device_step()
        except Exception as e:  # noqa: BLE001 (any failure: the reason is kept, the steps stay right)
            torch.cuda.synchronize(self.device)
            self.mode, self.why = "device", f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:300]})"
            return self._device_step()
        self.graph, self.logits = graph, out
        if self.quantized:
            self._signature = self.cache.buffer_signature()
        graph.replay()
        return out


def _static_length(cache) -> bool:
    """Whether a transformers cache keeps its length on the device and never reallocates
    (StaticCache: preallocated layers with a device `cumulative_length`)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
                                and getattr(layer, "is_compileable", False) for layer in layers)


__all__ = ["GraphedDecode", "GraphedDecodeStep"]
