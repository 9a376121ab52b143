"""Per-row fits (quantizers/fitted.py): a cache of B windows stores, row by row, what B
one-window caches store, so the batch harness scores the fitting quantizers in batches
and still measures one window at a time's NLL and bits.

- Quantizer level, every registered example config: a B-row write and a later append
  decode row b exactly as row b written alone, and the batch's bytes counted as row
  caches equal the one-row caches' bytes; for the fitting quantizers each row's stored
  bytes (segments and fitted tensors) are the one-row cache's, byte for byte. fp8 (one
  scale over all rows) fails this, which is why it is scored one window at a time, and
  shows the check can fail.
- The per-row fit on one row is the single-row fit as it was before per-row fitting
  (spelled out below from the same primitives, byte for byte).
- Model level, a tiny Llama: per-window NLL of a batch equals one window at a time
  within NLL_REL_TOL, bits exactly, under both protocols, with the batch really batched.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvqbench.quantizers import CorruptPackedError, get_quantizer, parse_spec, registry
from kvqbench.quantizers.vq import fit_residual_codebooks
from kvqbench.quantizers.base import stable_seed
from kvqbench.quantizers.fitted import FitsOnFirstWrite, nbytes_as_row_caches
from kvqbench.quantizers.packing import pack_bits
from kvqbench.quantizers.vq import fit_codebook_with_zero
from kvqbench.suites.conformance import head_dim_for, reference_tensor
from kvqbench.suites.harness.kv_cache import QuantizedCache, cache_kwargs
from kvqbench.suites.harness.perplexity import (
    batch_rows,
    ppl_prefill_then_decode,
    ppl_quantize_on_write,
    rows_independent,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# Configs beyond the registry's examples that fit something else per row: an outlier
# mask, per-head codebooks, a beam search, seeded (unfitted) codebooks.
EXTRA_SPECS = ["spherical:bits=3,outliers=8", "spherical:bits=2,outliers=32,rotation=hadamard",
               "flatvq:dim=4,K_bits=6,per_head=false", "avq:M=2,K_bits=6,beam=4,per_head=true",
               "avq:codebooks=gaussian"]
ALL_SPECS = [s for name in sorted(registry()) for s in registry()[name].examples()] + EXTRA_SPECS
FITTED_SPECS = [s for s in ALL_SPECS if issubclass(parse_spec(s)[0], FitsOnFirstWrite)]
CUT = 37  # the first write (the fit), then a 3-token append coded with it


def _rows_input(spec):
    x = reference_tensor(head_dim_for(spec), tokens=40, batch=3, outlier_channels=(3,), outlier_scale=8.0)
    x[1] *= 5.0  # rows of different ranges: a fit shared by the rows would show
    return x


def _write(spec, x, role):
    q = get_quantizer(spec, layer=1, role=role, seed=3)
    return q, q.append(q.encode(x[:, :, :CUT]), x[:, :, CUT:])


@pytest.mark.parametrize("role", ["K", "V"])
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_a_batch_stores_what_one_row_caches_store(spec, role):
    x = _rows_input(spec)
    q, p = _write(spec, x, role)
    y = q.decode(p)
    rows = [_write(spec, x[b:b + 1].clone(), role) for b in range(x.shape[0])]
    same = [torch.equal(y[b:b + 1], q1.decode(p1)) for b, (q1, p1) in enumerate(rows)]
    # Bytes as row caches: per-row tensors as stored, the rest once per row (the harness's figure).
    assert nbytes_as_row_caches(p, q) == sum(p1.nbytes for _, p1 in rows), spec
    if not rows_independent(type(q)):
        # fp8: one scale over all rows; rows 0 and 2 are coded with row 1's larger range.
        assert not all(same), f"{spec} says its rows depend on each other, yet they do not here"
        return
    assert all(same), f"{spec} {role}: rows {[b for b, s in enumerate(same) if not s]} decode otherwise alone"
    if not isinstance(q, FitsOnFirstWrite):
        return
    per_row = set(q.per_row_shared())
    for b, (q1, p1) in enumerate(rows):
        for name, t in p1.shared.items():  # fitted tensors: row b's are the one-row cache's
            got = p.shared[name][b:b + 1] if name in per_row else p.shared[name]
            assert got.dtype == t.dtype and torch.equal(got, t), (spec, name, b)
        for seg, seg1 in zip(p.segments, p1.segments, strict=True):
            for name, t in seg1.fields.items():
                assert torch.equal(seg.fields[name][b:b + 1], t), (spec, name, b)


# ---- the per-row fit is the single-row fit, byte for byte ------------------------------------
def _old_single_row_fit(q, x):
    """The fits as `fit_shared` computed them over a whole one-row write before the fit
    went per row (from the same primitives, same seeds): name -> tensor of make_shared's
    old shape (no row dimension)."""
    c = q.config
    gen = torch.Generator().manual_seed(stable_seed(q.name, q.seed, q.layer, q.role, "fit"))
    H = x.shape[1]
    if q.name == "flatvq":
        pts = x.reshape(1, H, -1, c.dim)[0]  # [H, N, dim]
        pts = pts if c.per_head else pts.reshape(1, -1, c.dim)
        return {"codebook": fit_codebook_with_zero(pts, 1 << c.K_bits, gen).half()}
    if q.name == "avq":
        shared = q.empty(x).shared
        z, _ = q._normalise(q._rotate(x, shared))
        pts = z.reshape(1, H, -1, c.dim)[0]
        pts = pts if c.per_head else pts.reshape(1, -1, c.dim)
        return {"codebooks": fit_residual_codebooks(pts, c.M, 1 << c.K_bits, gen).half()}
    if q.name == "spherical":
        rms = x.pow(2).mean(dim=(0, 2))
        mask = torch.zeros_like(rms, dtype=torch.long).scatter_(1, rms.topk(q.n_out(x.shape[-1]), dim=-1).indices, 1)
        return {"outlier_mask": pack_bits(mask, 1)}
    raise AssertionError(q.name)


@pytest.mark.parametrize("spec", [s for s in FITTED_SPECS if get_quantizer(s).per_row_shared()])
def test_per_row_fit_is_the_single_row_fit(spec):
    x = _rows_input(spec)
    q, p = _write(spec, x, "K")
    for b in range(x.shape[0]):
        old = _old_single_row_fit(get_quantizer(spec, layer=1, role="K", seed=3), x[b:b + 1, :, :CUT].clone())
        assert set(old) == set(q.per_row_shared())
        for name, t in old.items():
            got = p.shared[name][b]
            assert got.shape == t.shape and got.dtype == t.dtype, (name, got.shape, t.shape)
            assert bytes(got.contiguous().view(torch.uint8).numpy()) == bytes(t.contiguous().view(torch.uint8).numpy())
            assert not torch.equal(got, q.make_shared(x.shape[1], x.shape[3])[name][0])  # fitted, not the placeholder
    fitted = [p.shared[n] for n in q.per_row_shared()]
    assert all(not torch.equal(t[0], t[1]) for t in fitted), "rows of different data fitted the same tensors"


def test_only_fp8_fits_across_rows():
    """Every registered quantizer is batched except fp8, whose [H] scale the kernels read."""
    serial = sorted(name for name, cls in registry().items() if not rows_independent(cls))
    assert serial == ["fp8"], serial
    for name in ("avq", "flatvq", "spherical"):
        assert issubclass(registry()[name], FitsOnFirstWrite) and rows_independent(registry()[name])


def test_a_per_row_tensor_of_another_row_count_or_a_bad_row_is_refused():
    x = _rows_input("flatvq:dim=4,K_bits=8")
    q, p = _write("flatvq:dim=4,K_bits=8", x, "K")
    cb = p.shared["codebook"]
    short = dataclasses.replace(p, shared={"codebook": cb[:2]})
    with pytest.raises(CorruptPackedError, match="one per batch row"):
        q.decode(short)
    bad = cb.clone()
    bad[2, 0, 5, 0] = math.inf  # row 2 only: the base check of one row would not see it
    with pytest.raises(CorruptPackedError, match="NaN/Inf"):
        q.decode(dataclasses.replace(p, shared={"codebook": bad}))
    with pytest.raises(CorruptPackedError):
        q.decode(dataclasses.replace(p, shared={"codebook": cb[:, None]}))  # an extra dimension


# ---- model level: per-window NLL and bits, batched vs one at a time --------------------------
# Largest relative per-window NLL difference, batch of 3 vs one window at a time (CPU,
# fp32, one thread), measured over every FITTED_SPECS config, 3 window seeds and both
# protocols: 0 under quantize-on-write, at most 6.3e-6 under prefill-then-decode
# (spherical4-qjl: the one-token steps' batched matmuls round otherwise and a sketch
# sign flips). With the rows sharing one fit (avq, flatvq, outlier spherical fitted over
# the whole batch) the same runs moved a window by 4.9e-3 .. 2.2e-1. 1e-4: 16x the noise,
# 49x below the smallest such change (the same as test_decode_path's figure for totals).
NLL_REL_TOL = 1e-4
VOCAB = 128
_MODELS: dict[int, LlamaForCausalLM] = {}


def _model(d):
    if d not in _MODELS:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=2 * d, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=d, max_position_embeddings=256,
                          initializer_range=0.2, attn_implementation="sdpa")
        _MODELS[d] = LlamaForCausalLM(cfg).eval()
    return _MODELS[d]


def _per_window_nll(model, ids, spec, context):
    """Per-row summed NLL of one batch from a fresh cache: quantize-on-write (context
    None) or a prefill of `context` tokens then one-token decode steps."""
    cache = QuantizedCache(spec, config=model.config, seed=2, fused=False)
    kw = cache_kwargs(model, cache)
    with torch.inference_mode():
        if context is None:
            logits = model(input_ids=ids, **kw, use_cache=True).logits[:, :-1]
            targets = ids[:, 1:]
        else:
            out = [model(input_ids=ids[:, :context], **kw, use_cache=True).logits[:, -1:]]
            out += [model(input_ids=ids[:, t:t + 1], **kw, use_cache=True).logits for t in range(context, ids.shape[1] - 1)]
            logits, targets = torch.cat(out, 1), ids[:, context:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none")
    return nll.double().sum(-1)


@pytest.mark.parametrize("spec", FITTED_SPECS)
def test_batched_windows_give_each_windows_nll_and_bits(spec):
    d = max(32, head_dim_for(spec))
    model = _model(d)
    windows = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(11))
    batched = rows_independent(parse_spec(spec)[0])
    for context in (None, 14) if batched else ():  # (fp8's windows share a scale in a batch)
        many = _per_window_nll(model, windows, spec, context)
        one = torch.cat([_per_window_nll(model, windows[i:i + 1], spec, context) for i in range(3)])
        rel = ((many - one).abs() / one.abs()).max().item()
        assert rel <= NLL_REL_TOL, (spec, context, rel)
    # The harness: really batched (fp8 aside), the same bits to the byte, NLL as above.
    for fn, kw in ((ppl_quantize_on_write, {}), (ppl_prefill_then_decode, {"context": 14, "fused": False})):
        one = fn(model, windows, spec, seed=2, batch_size=1, **kw)
        many = fn(model, windows, spec, seed=2, batch_size=3, **kw)
        assert many["batch_size"] == (3 if batched else 1), spec
        assert batch_rows(model, spec, windows, 8, 1) == (3 if batched else 1)
        assert many["cache_nbytes"] == one["cache_nbytes"] and many["bits_per_element"] == one["bits_per_element"]
        assert many["nll_sum"] == pytest.approx(one["nll_sum"], rel=NLL_REL_TOL), (spec, fn.__name__)


@pytest.mark.parametrize("rows", [1, 3])  # 1: the one-row fit_shared; 3: the batched fit_shared_rows
def test_a_fit_returning_a_tensor_not_fitted_per_row_is_refused(rows, monkeypatch):
    q = get_quantizer("flatvq:dim=4,K_bits=6", layer=1, role="K", seed=3)
    real = type(q).fit_shared_rows
    monkeypatch.setattr(type(q), "fit_shared_rows", lambda self, x, shared: {**real(self, x, shared), "stray": x[:1]})
    x = reference_tensor(64, tokens=8, batch=rows)
    with pytest.raises(TypeError, match="returned \\['stray'\\], not in per_row_shared"):
        q.encode(x)
