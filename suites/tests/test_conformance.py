"""The conformance suite, run on every example config of every registered
quantizer (see conftest.py): shapes and dtypes, round-trip error within the
quantizer's own bound, appended writes, determinism, measured bits."""
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
