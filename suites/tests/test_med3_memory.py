"""HQMQ + Med3x: the store's held memory follows what it stores (kernels/formats/hqmq.py,
"Held memory"). A device-encoded prefill is given room for its worst case (half the
chunks of each token are outliers); the first host-position step after it gives the
excess back once the write's lengths are on the host, and `reserve` sizes the lists from
the real longest one plus the worst case of the reserved steps. Checked:

- after a prefill with few outliers and one step, the outlier buffer holds the longest
  list plus the steps' slack (`OUTLIER_SLACK_STEPS`), not the write's worst case, and the
  store's allocated bytes are within the factor that and the token capacity allow;
- decoding past that slack with every step at the worst case (the cut buffer must grow),
  and with every token of prefill and steps at the worst case, stores exactly what the
  reference (the quantizer's own encode and the store's old-path append) stores;
- `reserve` after such a prefill holds exactly the worst case of the reserved steps over
  the longest list, and device-position steps at the worst case fill it to the last entry
  without overflow, as host-position steps do.

CPU: the kernels run under the Triton interpreter, tiny shapes (head dim 32: 8 chunks, at
most 4 outliers a token).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvqbench.kernels.formats.hqmq import OUTLIER_SLACK_STEPS, per_head_outliers  # noqa: E402
from kvqbench.kernels.layout import whole_blocks  # noqa: E402
from kvqbench.suites.harness.kv_cache import QuantizedLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPEC = "hqmq:S=8,r=4,outliers=med3"
B, H, D = 1, 2, 32
MOST = D // 8  # a token's worst case: half its D/4 chunks exceed C = 3 times the lower median


def _data(tokens: int, seed: int, worst_from: int | None = None) -> torch.Tensor:
    """K and V `[2, B, H, tokens, D]`, Gaussian (few outliers); from token `worst_from` on,
    every token at the worst case: half its chunks 50 times the others' radius, so the lower
    median (of a step, and of any write holding only such tokens) is a small chunk's and
    exactly half the chunks exceed 3 times it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, B, H, tokens, D, generator=g)
    if worst_from is not None:
        w = x[:, :, :, worst_from:].reshape(2, B, H, -1, D // 4, 4)
        w[...] = w.sign().add(w == 0) * (0.5 + torch.rand(w.shape, generator=g))  # chunk radii within 2x
        w[..., : D // 8, :] *= 50
        x[:, :, :, worst_from:] = w.reshape(2, B, H, -1, D)
    return x.to(DEV, torch.float16)


def _layer(x, prefill: int, steps: int, *, device: bool, reserve: int = 0):
    """A fused layer: a `prefill`-token write, then `steps` one-token steps; `device`: the
    device encoders (the prefill's `hqmq_med3_write`, the step kernel), else the reference
    (the quantizer's encode, the store's append). `reserve`: the steps at a device
    position after reserving room for them (`step_at`, `advance`)."""
    layer = QuantizedLayer(SPEC, 0, seed=0)
    layer.fused_wanted, layer.step_encode, layer.prefill = True, device, "exact"
    layer.capacity_hint = prefill + steps
    with torch.inference_mode():
        layer.update(x[0, :, :, :prefill], x[1, :, :, :prefill])
        if reserve:
            layer.reserve(prefill + steps)
            pos = torch.tensor([prefill], dtype=torch.int32, device=DEV)
            for t in range(prefill, prefill + steps):
                for i, s in enumerate(layer.stores.values()):
                    s.step_at(x[i, :, :, t:t + 1], layer.errors.rows[i], pos)
                pos += 1
            layer.advance(steps)
        else:
            for t in range(prefill, prefill + steps):
                layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
    assert layer.mode == "fused" and layer.tokens == prefill + steps
    return layer


def _lists(store) -> list[torch.Tensor]:
    lens = store.outlier_len.tolist()
    return [store.outliers.view(B * H, -1, 4)[bh, :n] for bh, n in enumerate(lens)]


def _assert_same(new, ref):
    """The same stored bytes: outlier lists (lengths, entries, index blocks), the token
    fields (codes up to the device search's exact ties, as test_prefill_steps allows), the
    Packed's bytes and its segments' outliers regrouped per (b, h) (`per_head_outliers`)."""
    assert new.nbytes() == ref.nbytes()
    for role in ("K", "V"):
        sn, sr = new.stores[role], ref.stores[role]
        assert torch.equal(sn.outlier_len, sr.outlier_len), role
        assert all(torch.equal(a, b) for a, b in zip(_lists(sn), _lists(sr))), role
        assert torch.equal(sn.outlier_index.valid, sr.outlier_index.valid), role
        for name in ("flags", "radius", "r_max"):
            assert torch.equal(sn.buffers[name].valid, sr.buffers[name].valid), (role, name)
        codes = (sn.buffers["codes"].valid != sr.buffers["codes"].valid).float().mean()
        assert codes <= 0.01, role
        on, _ = per_head_outliers(new.packed[role], D // 4)
        assert torch.equal(on, per_head_outliers(ref.packed[role], D // 4)[0]), role


def _outlier_bytes(store) -> int:
    return store.outliers.numel() * store.outliers.element_size()


def test_a_prefill_with_few_outliers_gives_its_worst_case_room_back_at_the_next_step():
    P = 192
    x = _data(P + 1, seed=0)
    layer = QuantizedLayer(SPEC, 0, seed=0)
    layer.fused_wanted, layer.prefill, layer.capacity_hint = True, "exact", P + 1
    with torch.inference_mode():
        layer.update(x[0, :, :, :P], x[1, :, :, :P])
        held = {r: s.outliers.shape[2] for r, s in layer.stores.items()}
        layer.update(x[0, :, :, P:], x[1, :, :, P:])
    for role, s in layer.stores.items():
        longest = int(s.outlier_len.max())
        assert longest <= P // 4, f"{role}: the data meant to give few outliers gave {longest}"
        # the write's room (its worst case plus the steps' slack), until the step gave it back
        assert held[role] == whole_blocks(P * MOST + OUTLIER_SLACK_STEPS * MOST)
        room = whole_blocks(longest + (1 + OUTLIER_SLACK_STEPS) * MOST)  # (bound: the real longest before the step)
        assert s.outliers.shape[2] <= room < held[role] // 2, role
        # allocated within what the token buffers' capacity and that slack allow
        tokens = sum(b.nbytes for b in s.buffers.values())
        assert s.allocated_nbytes == tokens + _outlier_bytes(s) + s.outlier_index.nbytes
        assert _outlier_bytes(s) <= B * H * room * 8  # (4 fp16 an entry)
        cap = s.token_capacity / s.tokens
        assert s.allocated_nbytes <= cap * s.stored_nbytes + B * H * room * 8 + s.outlier_index.nbytes, role


def test_a_long_write_gives_its_room_back_at_once_and_stores_the_references_bytes(monkeypatch):
    # A write whose worst-case room passes MED3_CUT_AT_WRITE_BYTES (here: every write) reads
    # its lengths and cuts the lists right after it, before any step (a long prefill's peak
    # then holds one layer's worst case); the steps after it store the reference's bytes
    from kvqbench.kernels.formats import hqmq as hqmq_format

    monkeypatch.setattr(hqmq_format, "MED3_CUT_AT_WRITE_BYTES", 0)
    P, n = 192, 8
    x = _data(P + n, seed=2)
    layer = QuantizedLayer(SPEC, 0, seed=0)
    layer.fused_wanted, layer.prefill, layer.capacity_hint = True, "exact", P + n
    with torch.inference_mode():
        layer.update(x[0, :, :, :P], x[1, :, :, :P])
        for role, s in layer.stores.items():
            room = whole_blocks(int(s.outlier_len.max()) + (1 + OUTLIER_SLACK_STEPS) * MOST)
            assert s.outliers.shape[2] <= room < whole_blocks(P * MOST) // 2, role
            assert s.flat.outliers is s.outliers, role  # the kernels read the cut lists
        for t in range(P, P + n):
            layer.update(x[0, :, :, t:t + 1], x[1, :, :, t:t + 1])
    _assert_same(layer, _layer(x, P, n, device=False))


@pytest.mark.parametrize("worst_from", [192, 0], ids=["steps-worst", "all-worst"])
def test_decoding_past_the_slack_grows_the_cut_buffer_and_stores_the_references_bytes(worst_from):
    # 192-token prefill, then more steps than the slack (64), each at the worst case: a cut
    # buffer (few outliers in the prefill) must grow; with the prefill at the worst case
    # too, nothing is cut and every list ends at exactly its worst case
    P, n = 192, OUTLIER_SLACK_STEPS + 8
    x = _data(P + n, seed=1, worst_from=worst_from)
    new, ref = _layer(x, P, n, device=True), _layer(x, P, n, device=False)
    _assert_same(new, ref)
    for s in new.stores.values():
        lens = s.outlier_len.view(B, H)
        if worst_from == 0:
            assert (lens == (P + n) * MOST).all()
        else:
            assert (lens >= n * MOST).all() and int(lens.max()) <= n * MOST + P // 4
        assert s.outliers.shape[2] >= int(lens.max())


def test_reserve_holds_the_longest_list_plus_the_reserved_steps_worst_case():
    # after a prefill with few outliers, reserve(P + n): exactly room for n worst-case
    # steps over the longest list; n worst-case device-position steps fill the longest
    # list to its last entry, and store what host-position steps store
    P, n = 192, 8
    x = _data(P + n, seed=2, worst_from=P)
    dev = _layer(x, P, n, device=True, reserve=n)
    host = _layer(x, P, n, device=True)
    for role, s in dev.stores.items():
        lens = s.outlier_len
        longest_before = int(lens.max()) - n * MOST  # (every step added its worst case to every list)
        assert (lens - n * MOST >= 0).all() and longest_before <= P // 4
        assert s.outliers.shape[2] == whole_blocks(longest_before + n * MOST), role
    _assert_same(dev, host)
