"""Bad input gets a clear error naming the problem, or a defined result."""
import pytest
import torch

from kvqbench.quantizers import QuantizerInputError, get_quantizer, names, parse_spec

SPECS = ["fp16", "int4", "kivi:bits=2", "hqmq:S=16,r=4,outliers=med3"]


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


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected(spec, bad):
    x = torch.randn(1, 2, 8, 64)
    x[0, 1, 3, 5] = bad
    with pytest.raises(QuantizerInputError, match="NaN/Inf"):
        get_quantizer(spec).encode(x)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1, 2, 0, 64), (0, 2, 4, 64), (1, 0, 4, 64)])
def test_empty_tensor_rejected(spec, shape):
    with pytest.raises(QuantizerInputError, match="empty"):
        get_quantizer(spec).encode(torch.zeros(shape))


@pytest.mark.parametrize("spec", SPECS)
def test_wrong_dtype_and_rank_rejected(spec):
    q = get_quantizer(spec)
    with pytest.raises(QuantizerInputError, match="dtype"):
        q.encode(torch.zeros(1, 1, 4, 64, dtype=torch.int32))
    with pytest.raises(QuantizerInputError, match="dtype"):
        q.encode(torch.zeros(1, 1, 4, 64, dtype=torch.float64))
    with pytest.raises(QuantizerInputError, match="batch, kv_heads, tokens, head_dim"):
        q.encode(torch.zeros(4, 64))


@pytest.mark.parametrize("spec", SPECS)
def test_append_mismatch_rejected(spec):
    q = get_quantizer(spec)
    packed = q.encode(torch.randn(1, 2, 4, 64))
    with pytest.raises(QuantizerInputError, match="append of shape"):
        q.append(packed, torch.randn(1, 3, 1, 64))
    with pytest.raises(QuantizerInputError, match="append of torch.float16"):
        q.append(packed, torch.randn(1, 2, 1, 64, dtype=torch.float16))


@pytest.mark.parametrize("spec", SPECS)
def test_all_zero_chunks_decode_to_zero(spec):
    x = torch.randn(1, 2, 8, 64)
    x[0, 0] = 0  # whole token vectors of zeros
    x[0, 1, :, 8:12] = 0  # one zero chunk per token
    y = get_quantizer(spec).roundtrip(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0, 0], torch.zeros_like(y[0, 0]))
    if spec.startswith("hqmq"):
        assert torch.equal(y[0, 1, :, 8:12], torch.zeros_like(y[0, 1, :, 8:12]))


@pytest.mark.parametrize("spec", SPECS)
def test_fp16_overflow_is_an_error_not_inf(spec):
    x = torch.randn(1, 1, 8, 64)
    x[0, 0, 2, 0] = 1e6  # beyond fp16; the cache stores fp16 scales/values
    with pytest.raises(QuantizerInputError, match="overflows the fp16"):
        get_quantizer(spec).encode(x)


def test_fp16_input_whose_radius_overflows_is_an_error():
    x = torch.full((1, 1, 1, 4), 60000.0, dtype=torch.float16)  # |chunk| = 120000
    with pytest.raises(QuantizerInputError, match="radius"):
        get_quantizer("hqmq").encode(x)


def test_bad_role_rejected():
    with pytest.raises(QuantizerInputError, match="role"):
        get_quantizer("int4", role="Q")
