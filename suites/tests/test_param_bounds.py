"""Parameters that cannot run in reasonable memory and time are refused at once, with
the limit in the message (issue 25, item 5)."""
from __future__ import annotations

import time

import pytest
import torch

from kvqbench.quantizers import QuantizerInputError, get_quantizer
from kvqbench.quantizers.additive_vq import MAX_SEARCH
from kvqbench.quantizers.hqmq import MAX_S


@pytest.mark.parametrize("spec", ["hqmq:S=1000000", "hqmq:S=1000000000", f"hqmq:S={MAX_S + 1}",
                                  f"hqmq:S={MAX_S + 1},fill=true"])
def test_hqmq_secondaries_beyond_the_limit_are_refused(spec):
    t0 = time.perf_counter()
    with pytest.raises(QuantizerInputError, match=f"S must be in 1..{MAX_S}"):
        get_quantizer(spec)
    assert time.perf_counter() - t0 < 5  # refused before anything is allocated (it took 32 GB before)


@pytest.mark.parametrize("spec,limit", [("avq:M=16,K_bits=14,beam=64", f"exceeds {MAX_SEARCH}"),
                                        ("avq:M=16,K_bits=14", f"exceeds {MAX_SEARCH}"),
                                        ("avq:M=16,K_bits=16,beam=64", "K_bits must be in 1..14")])
def test_additive_vq_beyond_its_search_budget_is_refused(spec, limit):
    with pytest.raises(QuantizerInputError, match=limit):
        get_quantizer(spec)


@pytest.mark.parametrize("spec", [f"hqmq:S={MAX_S}", "hqmq:S=4000,fill=true", "avq:M=4,K_bits=12,beam=4",
                                  "avq:M=4,K_bits=14"])
def test_the_largest_allowed_configs_run_a_window(spec):
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    q = get_quantizer(spec)
    y = q.decode(q.encode(x))
    assert y.shape == x.shape and torch.isfinite(y).all()
