"""The conformance suite, run on every example config of every registered
quantizer (see conftest.py): shapes and dtypes, round-trip error within the
quantizer's own bound, appended writes, determinism, measured bits, model constants
(`constant_shared`) independent of the data."""
import pytest

from kvqbench.suites import conformance

pytestmark = pytest.mark.conformance


@pytest.mark.parametrize("role", ["K", "V"])
def test_shapes_dtypes_and_error_bound(quantizer_spec, role):
    conformance.check_shapes_dtypes_and_bound(quantizer_spec, role)


@pytest.mark.parametrize("role", ["K", "V"])
def test_appended_writes(quantizer_spec, role):
    conformance.check_append(quantizer_spec, role)


def test_deterministic_bytes(quantizer_spec):
    conformance.check_determinism(quantizer_spec)


def test_measured_bits(quantizer_spec):
    conformance.check_measured_bits(quantizer_spec)


def test_declared_model_constants_do_not_depend_on_the_data(quantizer_spec):
    conformance.check_constant_shared(quantizer_spec)


def test_hqmq_bound_catches_a_search_that_ignores_the_secondaries(monkeypatch):
    """The bound is tight enough to fail: a search that only ever uses secondary 0
    (so effectively 24 codewords, not 24 S) must exceed it."""
    import torch

    from kvqbench.quantizers.hqmq import HQMQ
    from kvqbench.quantizers.quaternion import conj, hamilton, nearest_hurwitz

    def search_ignoring_S(self, u, shared):
        s0 = self.secondaries(shared).to(u.device)[:, :1]  # [H, 1, 4]
        p, _ = nearest_hurwitz(hamilton(u, conj(s0).unsqueeze(0)))  # best p for s_0 alone
        return p * self.config.S

    conformance.check_shapes_dtypes_and_bound("hqmq:S=96,r=4", "K")  # holds with the real search
    monkeypatch.setattr(HQMQ, "search", search_ignoring_S)
    with pytest.raises(AssertionError, match="exceeds its stated bound"):
        conformance.check_shapes_dtypes_and_bound("hqmq:S=96,r=4", "K")
