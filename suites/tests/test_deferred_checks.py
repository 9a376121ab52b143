"""Value checks deferred to one host synchronisation (quantizers/checks.py): they still
fail loudly with their own message, and a decode step's write no longer reads values
back to the host for them."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvqbench.quantizers import QuantizerInputError, get_quantizer
from kvqbench.quantizers.checks import deferred_checks, flush, require
from kvqbench.suites.conformance import all_example_specs

HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")


def test_require_outside_a_block_raises_at_once():
    with pytest.raises(ValueError, match="now"):
        require(torch.tensor(True), lambda: ValueError("now"))
    require(torch.tensor(False), lambda: ValueError("never"))


def test_deferred_failure_is_raised_at_the_end_of_the_block_first_failure_first():
    reached = False
    with pytest.raises(ValueError, match="first"):
        with deferred_checks():
            require(torch.tensor(False), lambda: ValueError("fine"))
            require(torch.tensor(True), lambda: ValueError("first"))
            require(torch.tensor(True), lambda: ValueError("second"))
            reached = True
    assert reached
    require(torch.tensor(False), lambda: ValueError("the queue was dropped"))  # raises at once again


def test_flush_inside_a_block_raises_there_and_empties_the_queue():
    with deferred_checks():
        require(torch.tensor(True), lambda: KeyError("bad"))
        with pytest.raises(KeyError):
            flush()
        flush()  # nothing left


def test_an_error_inside_the_block_wins_over_queued_checks():
    with pytest.raises(RuntimeError, match="inner"):
        with deferred_checks():
            require(torch.tensor(True), lambda: ValueError("queued"))
            raise RuntimeError("inner")


def test_nan_input_still_fails_with_its_message_when_deferred():
    q = get_quantizer("int4")
    x = torch.randn(1, 2, 8, 64)
    x[0, 1, 3, 5] = float("nan")
    with pytest.raises(QuantizerInputError, match="1 NaN/Inf"):
        with deferred_checks():
            q.encode(x)


@pytest.mark.parametrize("spec", all_example_specs())
def test_a_one_token_append_reads_nothing_back_when_deferred(spec):
    """Inside deferred_checks a decode step's write makes no host read, except the
    ones the format's data-dependent field sizes need (e.g. Med3x's outlier count)."""
    for role in ("K", "V"):
        q = get_quantizer(spec, role=role)
        x = torch.randn(2, 3, 65, 64)
        packed = q.encode(x[:, :, :64])
        variable = q.segment_layout((2, 3, 1, 64))[1]
        with profile(activities=[ProfilerActivity.CPU]) as prof, deferred_checks():
            q.append(packed, x[:, :, 64:])
        reads = sum(e.name in HOST_READS for e in prof.events())
        assert reads <= len(variable), f"{spec} {role}: {reads} host reads in a one-token append"


@pytest.mark.parametrize("spec", all_example_specs())
def test_queued_checks_of_a_decode_do_not_keep_the_decoded_history_alive(spec):
    """A transient decode (the harness decodes a prefill's history into throwaway Segment
    objects) must be freed when its caller drops it, not held by a queued check's error
    factory until the next flush: on the H200 such a factory held every layer's decoded
    fp16 history (0.7 GiB at 32k tokens of the SmolLM2 shape) into the decode steps."""
    import dataclasses
    import gc
    import weakref

    from kvqbench.quantizers import Segment

    for role in ("K", "V"):
        q = get_quantizer(spec, role=role)
        x = torch.randn(1, 2, 160, 64)
        packed = q.encode(x[:, :, :64])
        for a in range(64, 160, 32):  # several segments: a format that merges runs merges them
            q.append(packed, x[:, :, a : a + 32])
        with deferred_checks():
            fresh = dataclasses.replace(packed, segments=[Segment(s.fields, s.tokens) for s in packed.segments])
            out = q.decode(fresh)
            alive = weakref.ref(out)
            del out, fresh
            if alive() is not None:  # not freed by its refcount: collect cycles, then judge (a full
                gc.collect()         # collection costs ~0.3 s in a suite-sized heap, so only here)
            assert alive() is None, f"{spec} {role}: a queued check keeps the decoded history alive"
