"""Hypothesis property tests of the algebra HQMQ stands on and of the packed
formats (`pytest -m property`)."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvqbench.quantizers import get_quantizer
from kvqbench.quantizers.packing import pack_bits, unpack_bits
from kvqbench.quantizers.quaternion import (
    conj,
    group_closure_table,
    hamilton,
    hurwitz_units,
    nearest_hurwitz,
    random_unit_quaternions,
)

pytestmark = pytest.mark.property

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=64)
quaternions = st.lists(finite, min_size=4, max_size=4).map(lambda v: torch.tensor(v, dtype=torch.float64))
nonzero = quaternions.filter(lambda q: q.norm() > 1e-3)
units = nonzero.map(lambda q: q / q.norm())
seeds = st.integers(0, 2**31 - 1)


def close(a, b, tol=1e-9):
    return torch.allclose(a, b, atol=tol * (1 + float(a.abs().max())), rtol=0)


# ---- Hamilton product ------------------------------------------------------------------
@given(quaternions, quaternions, quaternions)
def test_hamilton_associative(a, b, c):
    assert close(hamilton(hamilton(a, b), c), hamilton(a, hamilton(b, c)), 1e-12)


@given(quaternions, quaternions)
def test_norms_multiply(a, b):
    assert math.isclose(hamilton(a, b).norm(), a.norm() * b.norm(), rel_tol=1e-12, abs_tol=1e-12)


@given(nonzero)
def test_conjugate_inverts(q):
    one = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    inv = conj(q) / q.norm() ** 2
    assert close(hamilton(q, inv), one) and close(hamilton(inv, q), one)


@given(units, quaternions, quaternions)
def test_unit_multiplication_preserves_inner_products(s, a, b):
    ip = (a * b).sum()
    assert math.isclose((hamilton(s, a) * hamilton(s, b)).sum(), ip, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose((hamilton(a, s) * hamilton(b, s)).sum(), ip, rel_tol=1e-9, abs_tol=1e-9)


# ---- the group 2T ------------------------------------------------------------------------
def test_2t_is_a_group_of_24():
    P = hurwitz_units(torch.float64)
    assert P.shape == (24, 4) and close(P.norm(dim=-1), torch.ones(24, dtype=torch.float64))
    assert torch.unique(P, dim=0).shape[0] == 24
    table = group_closure_table()
    assert (table >= 0).all(), "2T is not closed under multiplication"
    identity = int(torch.nonzero((P == P.new_tensor([1, 0, 0, 0])).all(-1))[0])
    assert (table[identity] == torch.arange(24)).all() and (table[:, identity] == torch.arange(24)).all()
    assert ((table == identity).sum(1) == 1).all(), "every element has exactly one inverse"
    assert all(sorted(table[i].tolist()) == list(range(24)) for i in range(24)), "rows are permutations"


def test_2t_pairwise_angles_at_least_60_degrees():
    P = hurwitz_units(torch.float64)
    gram = P @ P.T - 2 * torch.eye(24, dtype=torch.float64)
    assert gram.max() <= 0.5 + 1e-12


@given(units)
def test_nearest_hurwitz_is_exact_and_covers_within_45_degrees(u):
    idx, score = nearest_hurwitz(u)
    P = hurwitz_units(torch.float64)
    brute = (P @ u).max()
    assert math.isclose(score, brute, abs_tol=1e-12)
    assert math.isclose((P[idx] * u).sum(), brute, abs_tol=1e-12)
    assert brute >= math.sqrt(0.5) - 1e-12  # 2T's covering radius is 45 degrees


@given(seeds, st.integers(1, 40))
def test_codebook_has_24S_distinct_codewords(seed, S):
    s = random_unit_quaternions(S, torch.Generator().manual_seed(seed)).double()
    C = hamilton(hurwitz_units(torch.float64)[:, None, :], s[None]).reshape(-1, 4)
    d = torch.cdist(C, C) + 10 * torch.eye(len(C), dtype=torch.float64)
    assert d.min() > 1e-9, "two codewords p*s coincide"
    assert C.shape[0] == 24 * S


# ---- HQMQ ----------------------------------------------------------------------------------
@given(seeds, st.integers(1, 48))
def test_fast_search_matches_brute_force(seed, S):
    q = get_quantizer(f"hqmq:S={S},r=4", seed=seed % 1000)
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(1, 2, 50, 4, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    shared = q.make_shared(2, 8)
    code = q.search(u, shared)
    s = q.secondaries(shared)
    C = hamilton(hurwitz_units()[:, None, None, :], s[None])  # [24, H, S, 4]
    brute = torch.einsum("bhnk,phsk->bhnps", u, C).flatten(-2).amax(-1)
    chosen = hamilton(hurwitz_units()[code // S], s[torch.arange(2).view(1, 2, 1), code % S])
    assert torch.allclose((u * chosen).sum(-1), brute, atol=1e-5)


def _codes(q, packed):
    seg = packed.segments[0]
    return seg.fields["codes"], seg.fields["radius"]


@given(seeds, st.sampled_from([8, 96]), st.integers(2, 6))
def test_reencoding_a_decoded_tensor_reproduces_its_codes(seed, S, r):
    q = get_quantizer(f"hqmq:S={S},r={r}", seed=1)
    x = torch.randn(1, 2, 6, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    packed = q.encode(x)
    again = q.encode(q.decode(packed))
    assert all(torch.equal(a, b) for a, b in zip(_codes(q, packed), _codes(q, again)))


@given(seeds, st.integers(-6, 6), st.booleans())
def test_positive_power_of_two_scaling_commutes(seed, k, med3):
    spec = "hqmq:S=32,r=4" + (",outliers=med3" if med3 else "")
    q = get_quantizer(spec)
    x = torch.randn(1, 2, 5, 32, generator=torch.Generator().manual_seed(seed))
    a = 2.0**k
    assert torch.equal(q.decode(q.encode(a * x)), a * q.decode(q.encode(x)))


@given(seeds, st.integers(1, 8), st.floats(4.0, 1000.0))
def test_med3x_keeps_outliers_exact(seed, n_out, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, 16, 32, generator=g)
    chunks = x.view(1, 1, 16 * 8, 4)
    picks = torch.randperm(16 * 8, generator=g)[:n_out]
    chunks[0, 0, picks] *= scale
    r = chunks.norm(dim=-1)
    is_out = r > 3 * r.flatten().median()
    q = get_quantizer("hqmq:S=16,r=4,outliers=med3")
    y = q.decode(q.encode(x)).view_as(chunks)
    assert torch.equal(y[is_out], chunks[is_out].half().float())
    assert not torch.equal(y[~is_out], chunks[~is_out])  # the rest really is coded


# ---- bit-packing ---------------------------------------------------------------------------
@given(st.integers(1, 16), st.integers(1, 70), seeds)
def test_bit_packing_round_trips(width, n, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 1 << width, (3, n), generator=g)
    v[0, 0] = (1 << width) - 1  # the extreme code
    packed = pack_bits(v, width)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == math.ceil(n * width / 8)
    assert torch.equal(unpack_bits(packed, width, n), v)


def test_packing_layout_is_lsb_first_little_endian():
    # 12-bit codes 0xABC, 0x123 -> bits of 0xABC then 0x123: bytes BC 3A 12
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]
