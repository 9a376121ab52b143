"""Bad input gets a clear error naming the problem, or a defined result. The
per-quantizer checks run on every example config of every registered quantizer
(the `quantizer_spec` fixture, conftest.py), so an out-of-tree plugin gets them too."""
import dataclasses

import pytest
import torch

from kvqbench.quantizers import CorruptPackedError, QuantizerInputError, get_quantizer, names, parse_spec
from kvqbench.suites.conformance import bound_excess, head_dim_for


def test_unknown_quantizer_lists_the_known_ones():
    with pytest.raises(QuantizerInputError, match=r"unknown quantizer 'int5'.*hqmq"):
        get_quantizer("int5")


@pytest.mark.parametrize("spec, match", [
    ("hqmq:S=0", "S must be"),
    ("hqmq:r=0", "radius bits"),
    ("hqmq:r=9", "radius bits"),
    ("hqmq:outliers=med5", "outliers must be"),
    ("hqmq:S=ten", "not a valid int"),
    ("hqmq:bits=4", "has no option 'bits'"),
    ("hqmq:S", "expected key=value"),
    ("int:bits=9", "bits must be"),
    ("int4:keys=diagonal", "per-token or per-channel"),
    ("int4:residual=-1", "residual must be"),
    ("kivi:residual=-1", "residual >= 0"),
    ("", "non-empty"),
])
def test_bad_config_values(spec, match):
    with pytest.raises(QuantizerInputError, match=match):
        get_quantizer(spec)


def test_aliases_and_options_parse():
    cls, cfg = parse_spec("int4:group=64")
    assert cls.name == "int" and cfg.bits == 4 and cfg.group == 64
    assert {"fp16", "int4", "kivi", "hqmq"} <= set(names())


def test_hqmq_needs_head_dim_divisible_by_4():
    with pytest.raises(QuantizerInputError, match="divisible by 4, got 6"):
        get_quantizer("hqmq").encode(torch.randn(1, 1, 3, 6))


def _x(spec, *lead, seed=0):
    """Seeded Gaussian [*lead, head_dim] with a head_dim the config accepts."""
    return torch.randn(*lead, head_dim_for(spec), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected(quantizer_spec, bad):
    x = _x(quantizer_spec, 1, 2, 8)
    x[0, 1, 3, 5] = bad
    with pytest.raises(QuantizerInputError, match="NaN/Inf"):
        get_quantizer(quantizer_spec).encode(x)


@pytest.mark.parametrize("lead", [(1, 2, 0), (0, 2, 4), (1, 0, 4)])
def test_empty_tensor_rejected(quantizer_spec, lead):
    with pytest.raises(QuantizerInputError, match="empty"):
        get_quantizer(quantizer_spec).encode(torch.zeros(*lead, head_dim_for(quantizer_spec)))


def test_wrong_dtype_and_rank_rejected(quantizer_spec):
    q, d = get_quantizer(quantizer_spec), head_dim_for(quantizer_spec)
    with pytest.raises(QuantizerInputError, match="dtype"):
        q.encode(torch.zeros(1, 1, 4, d, dtype=torch.int32))
    with pytest.raises(QuantizerInputError, match="dtype"):
        q.encode(torch.zeros(1, 1, 4, d, dtype=torch.float64))
    with pytest.raises(QuantizerInputError, match="batch, kv_heads, tokens, head_dim"):
        q.encode(torch.zeros(4, d))


def test_append_mismatch_rejected(quantizer_spec):
    q = get_quantizer(quantizer_spec)
    packed = q.encode(_x(quantizer_spec, 1, 2, 4))
    with pytest.raises(QuantizerInputError, match="append of shape"):
        q.append(packed, _x(quantizer_spec, 1, 3, 1))
    with pytest.raises(QuantizerInputError, match="append of torch.float16"):
        q.append(packed, _x(quantizer_spec, 1, 2, 1).half())


def test_zero_vectors_decode_within_the_bound(quantizer_spec):
    x = _x(quantizer_spec, 1, 2, 8)
    x[0, 0] = 0  # whole token vectors of zeros
    x[0, 1, :, 8:12] = 0  # one zero chunk per token
    q = get_quantizer(quantizer_spec)
    y = q.roundtrip(x)
    assert torch.isfinite(y).all()
    assert bound_excess(q, x, y) <= 0, "zero vectors decode outside the stated bound"


def test_hqmq_zero_chunks_decode_to_zero():
    x = torch.randn(1, 2, 8, 64)
    x[0, 0] = 0
    x[0, 1, :, 8:12] = 0
    y = get_quantizer("hqmq:S=16,r=4,outliers=med3").roundtrip(x)
    assert torch.equal(y[0, 0], torch.zeros_like(y[0, 0]))
    assert torch.equal(y[0, 1, :, 8:12], torch.zeros_like(y[0, 1, :, 8:12]))


def test_fp16_overflow_is_an_error_or_within_the_bound(quantizer_spec):
    """Values beyond fp16: a cache storing fp16 values or scales must refuse them
    rather than store inf; one that scales them into range must decode them."""
    x = _x(quantizer_spec, 1, 1, 8)
    x[0, 0, 2, 0] = 1e6
    q = get_quantizer(quantizer_spec)
    try:
        y = q.roundtrip(x)
    except QuantizerInputError as e:
        assert "fp16" in str(e) or "overflow" in str(e), str(e)
        return
    assert torch.isfinite(y).all() and bound_excess(q, x, y) <= 0


def test_int_group_range_beyond_an_fp16_step_is_an_error():
    x = torch.zeros(1, 1, 1, 32)
    x[..., 0], x[..., 1] = -60000.0, 60000.0  # storable values, but a 1-bit step of 120000 is not
    with pytest.raises(QuantizerInputError, match="step beyond the fp16"):
        get_quantizer("int:bits=1").encode(x)


def test_fp16_input_whose_radius_overflows_is_an_error():
    x = torch.full((1, 1, 1, 4), 60000.0, dtype=torch.float16)  # |chunk| = 120000
    with pytest.raises(QuantizerInputError, match="radius"):
        get_quantizer("hqmq").encode(x)


def test_bad_role_rejected():
    with pytest.raises(QuantizerInputError, match="role"):
        get_quantizer("int4", role="Q")


# ---- a Packed is checked against the quantizer that reads it (issue 13, item 5) ----------
def _segment_replaced(packed, index, **fields):
    seg = packed.segments[index]
    new = dataclasses.replace(seg, fields={**seg.fields, **fields}, _decoded=None)
    segs = list(packed.segments)
    segs[index] = new
    return dataclasses.replace(packed, segments=segs)


def test_another_configs_cache_is_refused():
    x = torch.randn(1, 2, 16, 64)
    with pytest.raises(CorruptPackedError, match=r"written by 'hqmq:S=96,r=4[^']*radius=uniform"):
        get_quantizer("hqmq:radius=log").decode(get_quantizer("hqmq").encode(x))
    with pytest.raises(CorruptPackedError, match="written by 'int:bits=4"):
        get_quantizer("kivi:bits=4").decode(get_quantizer("int4").encode(x))


def test_append_onto_another_format_is_refused():
    x = torch.randn(1, 2, 16, 64)
    with pytest.raises(CorruptPackedError, match="one cache holds one format"):
        get_quantizer("int4").append(get_quantizer("fp16").encode(x), x[:, :, :1])
    with pytest.raises(CorruptPackedError, match="one cache holds one format"):
        get_quantizer("kivi:bits=4").append(get_quantizer("int4").encode(x), x[:, :, :1])


def test_a_field_cut_short_is_refused_not_broadcast():
    q = get_quantizer("int4")
    packed = q.encode(torch.randn(1, 2, 16, 64))
    cut = _segment_replaced(packed, 0, scale=packed.segments[0].fields["scale"][..., :1])
    with pytest.raises(CorruptPackedError, match=r"field 'scale' has shape \(1, 2, 16, 1\); the format stores"):
        q.decode(cut)


def test_a_retyped_field_is_refused():
    q = get_quantizer("hqmq:S=16,r=4")
    packed = q.encode(torch.randn(1, 2, 4, 64))
    retyped = _segment_replaced(packed, 0, codes=packed.segments[0].fields["codes"].view(torch.int8))
    with pytest.raises(CorruptPackedError, match="field 'codes' is torch.int8; the format stores torch.uint8"):
        q.decode(retyped)


def test_a_flipped_scale_byte_that_decodes_to_inf_is_an_error():
    q = get_quantizer("int4")
    packed = q.encode(torch.randn(1, 2, 16, 64))
    scale = packed.segments[0].fields["scale"].clone()
    scale.view(torch.uint8).view(-1)[1] |= 0x7C  # one byte: the first scale's exponent bits all set
    with pytest.raises(CorruptPackedError, match="NaN/Inf"):
        q.decode(_segment_replaced(packed, 0, scale=scale))


def test_finite_bytes_that_overflow_the_cache_dtype_are_an_error():
    q = get_quantizer("int4")
    x = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    packed = q.encode(x)
    big = torch.full_like(packed.segments[0].fields["scale"], 60000.0)  # finite, but 15 x 60000 > fp16
    with pytest.raises(CorruptPackedError, match="overflows torch.float16"):
        q.decode(_segment_replaced(packed, 0, scale=big))


def test_a_segment_of_a_length_the_format_never_stores_is_refused():
    q = get_quantizer("int4:keys=per-channel", role="K")
    packed = q.encode(torch.randn(1, 2, 64, 64))  # two full 32-token groups
    seg = packed.segments[0]
    bad = dataclasses.replace(packed, segments=[dataclasses.replace(seg, tokens=31, _decoded=None)])
    with pytest.raises(CorruptPackedError, match="segment 0"):
        q.decode(bad)
