"""The packed caches the latency run reads: real encodings of synthetic K/V.

`t0` tokens of synthetic K/V (the toolkit's `synthetic_kv`: Gaussian; keys with
three 25x outlier channels) are encoded once per method (HQMQ through the kernel
encoder, the rest through the quantizer) and flattened into the kernel layout;
every larger (B, T) is that cache tiled (the toolkit's `tile_to`), so no shape pays
for another encode.
"""
from __future__ import annotations

import dataclasses

import torch

from ....kernels.formats.hqmq import engine_table
from ....kernels.hqmq_encode import encode_with_kernel
from ....kernels.layout import flatten
from ....quantizers import Packed, Quantizer, Segment, get_quantizer
from ....quantizers.packing import unpack_bits
from ..toolkit import synthetic_kv, tile_to
from .config import METHOD_SPECS


@dataclasses.dataclass
class EncodedCache:
    """One method's encoded K/V: the quantizers, their Packed caches and kernel layouts."""

    spec: str
    qk: Quantizer
    qv: Quantizer
    pk: Packed
    pv: Packed
    kf: object  # kernels.layout *Flat of pk
    vf: object


def encode_caches(device, hkv: int, t0: int, d: int) -> dict[str, EncodedCache]:
    """{method: its encoded cache} for every method with a packed cache (config.METHOD_SPECS);
    methods of the same spec share one encoding."""
    k, v = synthetic_kv(1, hkv, t0, d, device)
    by_spec: dict[str, EncodedCache] = {}
    for spec in dict.fromkeys(METHOD_SPECS.values()):
        qk, qv = get_quantizer(spec, role="K"), get_quantizer(spec, role="V")
        # a quantizer with a searched codebook (HQMQ) encodes through the kernel search
        enc = encode_with_kernel if hasattr(qk, "search") else (lambda q, x: q.encode(x))
        pk, pv = enc(qk, k), enc(qv, v)
        kf, vf = flatten(pk, "K"), flatten(pv, "V")
        table = engine_table(device) if hasattr(kf, "with_table") else None
        if table:  # the codeword source the engine gives the kernels (QuantizedCache's hqmq_table="auto")
            kf, vf = kf.with_table(*table), vf.with_table(*table)
        by_spec[spec] = EncodedCache(spec, qk, qv, pk, pv, kf, vf)
    return {method: by_spec[spec] for method, spec in METHOD_SPECS.items()}


def tiled(cache: EncodedCache, B: int, T: int):
    """The K and V layouts of `cache` tiled to B sequences of T tokens; ValueError where T
    does not fit (not a multiple of the encoded tokens, or of KIVI's groups)."""
    return tile_to(cache.kf, B, T), tile_to(cache.vf, B, T)


def hqmq_segment(flat) -> Segment:
    """The HQMQ Segment (what `HQMQ.decode_tokens` reads) holding the valid tokens of an
    HQMQFlat, for the fake-quant pipeline that decodes a whole tiled cache in torch. The
    layout keeps Med3x outliers per (b, h) `[B, H, Ocap, 4]` (the first n of each valid);
    the quantizer stores them in one (b, h, t, chunk) list."""
    T = flat.T
    fields = {"codes": flat.codes[:, :, :T], "radius": flat.radius[:, :, :T], "r_max": flat.r_max[:, :, :T]}
    if flat.has_outliers:
        flags = flat.flags[:, :, :T]
        per_bh = unpack_bits(flags, 1, flat.D // 4).sum((2, 3))  # [B, H]
        valid = torch.arange(flat.outliers.shape[2], device=flags.device) < per_bh[..., None]
        fields.update(flags=flags, outliers=flat.outliers[valid])
    return Segment(fields, T)
