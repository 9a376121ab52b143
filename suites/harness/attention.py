"""Fused decode attention inside the model, through transformers' `AttentionInterface`.

    with fused_attention(model):                    # registers "kvqbench", switches to it
        cache = QuantizedCache("hqmq:S=96,r=4", config=model.config)
        model.generate(ids, max_new_tokens=64, **cache_kwargs(model, cache))

A `QuantizedCache` whose model runs the "kvqbench" attention keeps each layer's packed
K/V in a `KernelStore` (kernels/store.py: preallocated device buffers in the layout
the fused kernels read). For a one-token decode step its `update` returns a
`PackedHistory` handle instead of dense K/V (so does a dense layer of a left-padded batch:
`QuantizedCache.set_row_start`; the handle masks each row's pads), and the function
registered here runs the fused kernel (kernels/decode_attention.py) over the store: the quantized history
is never decoded to a dense tensor. Everything else (prefill: many queries; a padding
mask; softcap; a sliding window; dropout) goes to transformers' own SDPA attention;
a handle reaching that path is decoded transiently (`PackedHistory.dense`).

The mask function registered beside it (`kvqbench_mask`) is transformers' SDPA mask,
so the model builds exactly the masks it builds for "sdpa", except that an unpadded
one-token step gets no mask (None) also while a CUDA graph is being captured: SDPA's
mask refuses that skip under any tracing or stream capture (a traced prefill would
hard-code `is_causal`), and would then bake a mask sized by the host's length into the
graph. One query over the whole history needs no mask, traced or not.
"""
from __future__ import annotations

import contextlib
import math

import torch

ATTN_NAME = "kvqbench"


class PackedHistory:
    """What a quantized layer hands attention for a fused decode step: its K and V
    stores (one handle serves as both `key` and `value`)."""

    def __init__(self, layer):
        self.layer = layer

    @property
    def shape(self) -> tuple[int, int, int, int]:  # [B, Hkv, T, D], as dense K would be
        p = self.layer.packed["K"]
        return (p.batch, p.heads, self.layer.get_seq_length(), p.head_dim)

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """softmax(q K^T * scaling) V over the whole history: `[B, Hq, 1, D]`."""
        D = query.shape[-1]
        if scaling is not None and not math.isclose(scaling * math.sqrt(D), 1.0, rel_tol=1e-6):
            query = query * (scaling * math.sqrt(D))  # the kernels scale by 1/sqrt(d)
        return self.layer.fused_attend(query)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded history (transient): for the cases the fused kernel does not serve."""
        return self.layer.read("K"), self.layer.read("V")

    def pad_mask(self) -> torch.Tensor | None:
        """`[B, 1, 1, T]` bool, False at each row's pads (a left-padded batch: the layer's
        row starts), for a read of `dense()` under another mask; None: no padding."""
        return self.layer.pad_mask()


def kvqbench_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs):
    """transformers attention function: fused over a `PackedHistory`, else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if isinstance(key, PackedHistory):
        plain = (attention_mask is None and query.shape[2] == 1 and not dropout
                 and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
                 and not kwargs.get("output_attentions"))
        if plain:
            out = key.attend(query, scaling)  # [B, Hq, 1, D] (each row's pads masked: the layer's row starts)
            return out.transpose(1, 2).contiguous(), None
        pads = key.pad_mask()
        key, value = key.dense()
        if pads is not None:  # a left-padded batch: its pads out of the model's mask too
            if attention_mask is None:
                attention_mask = pads
            elif attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & pads
            else:
                attention_mask = attention_mask.masked_fill(~pads, torch.finfo(attention_mask.dtype).min)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def kvqbench_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs):
    """transformers mask function: None for an unpadded one-token causal step (module
    docstring), else exactly `sdpa_mask`'s mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (q_length == 1 and not args and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None
            and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and kwargs.get("allow_is_causal_skip", True)):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, **kwargs)


def register() -> str:
    """Register the "kvqbench" attention and its mask (`kvqbench_mask`) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, kvqbench_attention)
    AttentionMaskInterface.register(ATTN_NAME, kvqbench_mask)
    return ATTN_NAME


def _configs(model):
    """The model's config and every sub-config that names an attention implementation."""
    seen, out = set(), []
    stack = [model.config]
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if hasattr(c, "_attn_implementation"):
            out.append(c)
        for k in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, k, None)
            if sub is not None:
                stack.append(sub)
    return out


def uses_fused_attention(config) -> bool:
    return getattr(config, "_attn_implementation", None) == ATTN_NAME


@contextlib.contextmanager
def fused_attention(model):
    """Run `model` with the "kvqbench" attention inside the block; restore after."""
    register()
    saved = [(c, c._attn_implementation) for c in _configs(model)]
    try:
        for c, _ in saved:
            c._attn_implementation = ATTN_NAME
        yield model
    finally:
        for c, impl in saved:
            c._attn_implementation = impl


__all__ = ["ATTN_NAME", "PackedHistory", "fused_attention", "kvqbench_attention", "kvqbench_mask", "register",
           "uses_fused_attention"]
