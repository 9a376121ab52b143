"""An out-of-tree fused format, with zero edits to the tree: a throwaway installed package
ships a quantizer (`absfused.py`, through the `kvqbench.quantizers` entry point group) and
its format (`absfused_format.py`, through `kvqbench.formats`): a Flat type, its flatten,
its store fields, a device step encoder and a decode-attention kernel, both in Triton.
The cache then decodes through that kernel fused, its decode steps encoded on the device,
graphed (device-position steps; CUDA graphs on a GPU), and the benchmarks list it.
(kernels/FORMATS.md walks through the same files.)"""
from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (see test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvqbench import quantizers  # noqa: E402
from kvqbench.kernels import registry  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

QUANTIZER = '''
"""absfused.py: symmetric absmax ints, one fp16 scale per token vector."""
import dataclasses

import torch

from kvqbench.quantizers.base import Quantizer, Segment, check_fp16_storable
from kvqbench.quantizers.packing import pack_bits, unpack_bits


class AbsFused(Quantizer):
    name = "absfused"
    description = "toy: symmetric absmax ints per token vector, fp16 scale, with a fused kernel"
    example_specs = ("absfused:bits=4",)

    @dataclasses.dataclass
    class Config:
        bits: int = 4

    def levels(self) -> int:
        return (1 << (self.config.bits - 1)) - 1

    def encode_tokens(self, x, shared):
        scale = x.abs().amax(-1, keepdim=True) / self.levels()
        check_fp16_storable("scale", scale)
        s = scale.half()
        safe = torch.where(s > 0, s.float(), torch.ones_like(scale))
        codes = torch.round(x / safe).clamp(-self.levels(), self.levels()) + self.levels()
        return Segment({"codes": pack_bits(codes.long(), self.config.bits), "scale": s}, x.shape[2])

    def decode_tokens(self, seg, shared, shape):
        codes = unpack_bits(seg.fields["codes"], self.config.bits, shape[-1]).float()
        return (codes - self.levels()) * seg.fields["scale"].float()

    def formula_bits(self, head_dim):
        return self.config.bits + 16 / head_dim

    def error_bound(self, x):
        amax = x.abs().amax(-1, keepdim=True)
        s = (amax / self.levels()).half().float()
        per_element = s / 2 + (amax - self.levels() * s).clamp(min=0)
        return per_element.expand_as(x).norm(dim=-1)
'''

FORMAT = '''
"""absfused_format.py: the fused format of absfused caches (Flat, flatten, store fields,
device step encoder, Triton decode-attention kernel)."""
import dataclasses
import math

import torch
import triton
import triton.language as tl

from kvqbench.kernels.common import bh_stride, check_q, check_valid_len, choose_splits
from kvqbench.kernels.layout import concat_field
from kvqbench.kernels.registry import Format, Kernel
from kvqbench.kernels.step_encode import device_pos, flag, launch, nonfinite, pack_row, rne, token_program
from kvqbench.kernels.triton.common import (LOG2E, finish, launch_split, nbytes_span, scores, softmax_update,
                                            split_prologue, store_partial, unpack_rows, valid_tokens)
from kvqbench.quantizers import Packed, parse_spec

from absfused import AbsFused


@dataclasses.dataclass
class AbsFlat:
    B: int
    H: int
    T: int  # valid tokens (the buffers' axis 2 is the capacity)
    D: int
    bits: int
    codes: torch.Tensor  # [B, H, Tcap, D * bits / 8] uint8
    scale: torch.Tensor  # [B, H, Tcap, 1] fp16
    dtype: torch.dtype = torch.float16


def flatten(packed: Packed, role=None) -> AbsFlat:
    _, cfg = parse_spec(packed.spec)
    return AbsFlat(B=packed.batch, H=packed.heads, T=packed.tokens, D=packed.head_dim, bits=cfg.bits,
                   codes=concat_field(packed, "codes"), scale=concat_field(packed, "scale"), dtype=packed.dtype)


# ---- decode attention: a tile decoder and the split kernel, on the Triton backend's pieces
@triton.jit
def _tile(codes_ptr, scale_ptr, bh, tok, tmask, cs, ss, BT: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
          CB: tl.constexpr, CNB: tl.constexpr, FAST: tl.constexpr, RND: tl.constexpr):
    L: tl.constexpr = (1 << (W - 1)) - 1
    bh64 = bh.to(tl.int64)
    code = unpack_rows(codes_ptr + bh64 * cs, tok * CB, tmask, BT, D, W, CB, CNB).to(tl.float32)
    s = tl.load(scale_ptr + bh64 * ss + tok, mask=tmask, other=0).to(tl.float32)
    return finish((code - L) * s[:, None], FAST, RND)


@triton.jit
def _split_kernel(q_ptr, kc, ks, vc, vs, po_ptr, pm_ptr, pl_ptr, T, tiles_per_split, qk_scale,
                  k_cs, k_ss, v_cs, v_ss, vlen_ptr, VLEN: tl.constexpr, GROUP: tl.constexpr, BH: tl.constexpr,
                  D: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, CB: tl.constexpr, CNB: tl.constexpr,
                  FAST: tl.constexpr, RND: tl.constexpr):
    T = valid_tokens(T, vlen_ptr, VLEN)
    pid_bh, sp, nsplit, q, qrow, hmask, m_i, l_i, acc, first, last = split_prologue(
        q_ptr, tl.cdiv(T, BT), tiles_per_split, GROUP, BH, D, FAST)
    for ti in range(first, last):
        tok = ti * BT + tl.arange(0, BT)
        tmask = tok < T
        k = _tile(kc, ks, pid_bh, tok, tmask, k_cs, k_ss, BT, D, W, CB, CNB, FAST, RND)
        s = scores(q, tl.trans(k), tmask, qk_scale, FAST)
        v = _tile(vc, vs, pid_bh, tok, tmask, v_cs, v_ss, BT, D, W, CB, CNB, FAST, RND)
        m_i, l_i, acc = softmax_update(s, v, m_i, l_i, acc, FAST)
    store_partial(po_ptr, pm_ptr, pl_ptr, acc, m_i, l_i, qrow, hmask, sp, nsplit, D)


def decode_attention(q, k: AbsFlat, v: AbsFlat, *, num_splits=None, block_t=64, num_warps=4, num_stages=2,
                     programs_per_sm=8, workspace=None, out_dtype=None, valid_len=None):
    B, H, T, D = k.B, k.H, k.T, k.D
    check_q(q, H, D, B)
    vl, has_vl = check_valid_len(valid_len, q)
    q = q.contiguous()
    nsplit, per = choose_splits(B * H, triton.cdiv(T, block_t), q.device, num_splits, programs_per_sm)
    runtime = [T, per, LOG2E / math.sqrt(D), bh_stride(k.codes, "codes"), bh_stride(k.scale, "scale"),
               bh_stride(v.codes, "codes"), bh_stride(v.scale, "scale"), vl]
    const = {"VLEN": has_vl, "BT": block_t, "W": k.bits, "CB": k.codes.shape[-1], "CNB": nbytes_span(D, k.bits)}
    return launch_split(_split_kernel, [k.codes, k.scale, v.codes, v.scale], runtime, const, q, B, H, nsplit, D,
                        num_warps, num_stages, workspace, k.dtype, out_dtype)


# ---- the device step encoder: AbsFused.encode_tokens of one token, op for op
@triton.jit(do_not_specialize=["t0"])
def _step_kernel(x_ptr, sxb, sxh, c_ptr, c_h, c_t, s_ptr, s_h, s_t, t0, H, err_ptr, pos_ptr,
                 DEVPOS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, NB: tl.constexpr,
                 NBP: tl.constexpr):
    t0, bh, b, h, t = token_program(t0, pos_ptr, H, DEVPOS)
    L: tl.constexpr = (1 << (W - 1)) - 1
    d = tl.arange(0, DP)
    dm = d < D
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + h * sxh + d, mask=dm, other=0.0).to(tl.float32)
    bad = nonfinite(x) & dm
    scale = tl.math.div_rn(tl.max(tl.where(dm, tl.abs(x), 0.0), axis=0), L * 1.0)
    s16 = scale.to(tl.float16)
    s = s16.to(tl.float32)
    code = rne(tl.math.div_rn(x, tl.where(s > 0, s, 1.0)))
    code = tl.where(dm, tl.minimum(tl.maximum(code, -L * 1.0), L * 1.0) + L, 0.0).to(tl.int32)
    bh64 = bh.to(tl.int64)
    tok = t0 + t
    j = tl.arange(0, NBP)
    tl.store(c_ptr + bh64 * c_h + tok * c_t + j, pack_row(code, W, DP, NBP).to(tl.uint8), mask=j < NB)
    tl.store(s_ptr + bh64 * s_h + tok * s_t, s16)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    flag(err_ptr, tl.where(n_bad > 0, 1, 0) | tl.where(scale > 65504.0, 2, 0), n_bad, tok)


def encode_step(store, x, errors, t0, pos=None):
    f = store.flat
    B, H, _, D = x.shape
    pos_arg, devpos = device_pos(pos, x)
    nb = D * f.bits // 8
    launch(_step_kernel, (B * H, 1), x, x.stride(0), x.stride(1), f.codes, f.codes.stride(1), f.codes.stride(2),
           f.scale, f.scale.stride(1), f.scale.stride(2), t0, H, errors, pos_arg, DEVPOS=devpos, D=D,
           DP=triton.next_power_of_2(D), W=f.bits, NB=nb, NBP=triton.next_power_of_2(nb))


FORMAT = Format(
    name="absfused", quantizer=AbsFused, flat=AbsFlat, flatten=flatten,
    token_fields=("codes", "scale"), step=encode_step,
    kernels=(Kernel("triton", decode_attention, title="Triton absfused kernel"),),
    bench={"absfused4": "absfused:bits=4"},
)
'''


def _install(tmp_path, monkeypatch, files: dict, entry_points: str):
    for name, code in files.items():
        (tmp_path / name).write_text(textwrap.dedent(code))
    dist = tmp_path / "absfused-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: absfused\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(tmp_path))
    quantizers.registry(refresh=True)
    registry.formats(refresh=True)


def _uninstall(monkeypatch, modules):
    monkeypatch.undo()
    for m in modules:
        sys.modules.pop(m, None)
    quantizers.registry(refresh=True)
    registry.formats(refresh=True)


@pytest.fixture
def installed_format(tmp_path, monkeypatch):
    """The package as an installed distribution (dist-info with both entry points) on sys.path."""
    _install(tmp_path, monkeypatch, {"absfused.py": QUANTIZER, "absfused_format.py": FORMAT}, """\
        [kvqbench.quantizers]
        absfused = absfused:AbsFused

        [kvqbench.formats]
        absfused = absfused_format:FORMAT
        """)
    yield tmp_path
    _uninstall(monkeypatch, ("absfused", "absfused_format"))


def _kv(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g) * 2).to(DEV, torch.float16)


def test_the_format_is_registered_found_by_its_quantizer_and_listed_for_the_benchmarks(installed_format):
    fmt = registry.formats()["absfused"]
    assert not registry.broken_formats()
    assert registry.format_of_quantizer(quantizers.registry()["absfused"]) is fmt
    assert registry.bench_specs()["absfused4"] == "absfused:bits=4"
    assert set(registry.formats()) >= {"naive_int", "fp8", "kivi", "hqmq", "absfused"}


def test_the_benchmarks_list_it(installed_format, monkeypatch):
    """Every rig that times fused formats reads the registry: the plugin's spec is in each list."""
    from kvqbench.suites.bench.asv_benchmarks import common as asv_common
    from kvqbench.suites.bench.decode.__main__ import default_specs
    from kvqbench.suites.bench.kernel_sweep import measure as sweep
    from kvqbench.suites.bench.latency import config as latency

    assert latency.FUSED_SPECS["fused-absfused4"] == "absfused:bits=4"
    assert latency.METHOD_SPECS["fused-absfused4"] == "absfused:bits=4"
    assert "absfused:bits=4" in default_specs()
    assert "absfused:bits=4" in asv_common.fused_specs()
    monkeypatch.setattr(sweep, "METHODS", {})  # (filled at its first use)
    assert sweep.registered_methods()["absfused4"] == ("absfused:bits=4", {})


def test_its_kernel_takes_the_call_and_matches_the_reference(installed_format):
    from kvqbench.kernels.decode_attention import decode_attention, explain_backend, reference_decode_attention
    from kvqbench.kernels.layout import flatten

    B, Hq, H, T, D = 2, 4, 2, 150, 32
    qk, qv = (quantizers.get_quantizer("absfused:bits=4", role=r) for r in "KV")
    pk, pv = qk.encode(_kv(B, H, T, D, 1)), qv.encode(_kv(B, H, T, D, 2))
    kf, vf = flatten(pk, "K"), flatten(pv, "V")
    assert type(kf).__name__ == "AbsFlat"
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    route = explain_backend(q, kf, vf)
    assert (route.backend, route.format) == ("triton", "absfused"), route
    out = decode_attention(q, kf, vf, num_splits=3, out_dtype=torch.float32)
    ref = reference_decode_attention(q, qk.decode(pk), qv.decode(pv))
    err = float((out - ref).norm() / ref.norm())
    assert err < (1e-5 if DEV.type == "cpu" else 3e-3), err


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval().to(torch.float32 if DEV.type == "cpu" else torch.bfloat16).to(DEV)


def _decode(model, steps: int, *, graphed: bool, step_encode: bool = True, batch=2, prompt=12):
    from kvqbench.kernels.graphs import GraphedDecodeStep
    from kvqbench.suites.harness.attention import fused_attention
    from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), fused_attention(model):
        cache = QuantizedCache("absfused:bits=4", config=model.config, fused=True, seed=1, step_encode=step_encode)
        kw = cache_kwargs(model, cache)
        tok = model(input_ids=ids.to(DEV), **kw, use_cache=True).logits[:, -1:].argmax(-1)
        step = GraphedDecodeStep(model, cache, batch, max_tokens=prompt + steps + 4) if graphed else None
        out = []
        for _ in range(steps):
            logits = step(tok).clone() if step is not None else model(input_ids=tok, **kw, use_cache=True).logits
            out.append(logits)
            tok = logits[:, -1:].argmax(-1)
        return torch.cat(out, 1), cache, step


def test_the_cache_decodes_through_it_fused_and_graphed(installed_format):
    model = _tiny_llama()
    quantizer_path, cq, _ = _decode(model, 3, graphed=False, step_encode=False)  # the quantizer's own writes
    eager, ce, _ = _decode(model, 3, graphed=False)
    graphed, cg, step = _decode(model, 3, graphed=True)
    for cache in (ce, cg):
        assert all(layer.mode == "fused" for layer in cache.layers)
        assert all(type(s.flat).__name__ == "AbsFlat" and s.in_run for layer in cache.layers
                   for s in layer.stores.values()), "the steps did not go through the device step encoder"
    assert step.mode == ("graph" if DEV.type == "cuda" else "device"), step.why  # device: the graph's steps, uncaptured
    assert cg.get_seq_length() == 12 + 3
    if DEV.type == "cpu":  # the interpreter: exact fp32, one split either way
        assert torch.equal(graphed, eager) and torch.equal(eager, quantizer_path)
    else:
        assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
    # the device step encoder stores the quantizer's bytes: same cache as its own writes
    for la, lb in zip(ce.layers, cq.layers):
        for role in "KV":
            fa, fb = la.packed[role], lb.packed[role]
            assert fa.nbytes == fb.nbytes and torch.equal(la.read(role), lb.read(role)), role


def test_a_broken_out_of_tree_format_is_left_out_and_named(tmp_path, monkeypatch):
    with pytest.warns(RuntimeWarning, match="fused format skipped"):
        _install(tmp_path, monkeypatch, {"broken_format.py": "raise ImportError('no such kernel here')\n"}, """\
            [kvqbench.formats]
            broken = broken_format:FORMAT
            """)
    try:
        (b,) = registry.broken_formats()
        assert "broken = broken_format:FORMAT" in b.origin and "no such kernel here" in b.error
        assert set(registry.formats()) >= {"naive_int", "fp8", "kivi", "hqmq"}  # the others keep working
    finally:
        _uninstall(monkeypatch, ("broken_format",))
