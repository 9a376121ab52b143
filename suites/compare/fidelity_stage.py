"""The compare's generation-fidelity stage (suites/harness/fidelity.py's figures in
results.json's `fidelity`): the unquantized model's reference continuations once per run,
the figures of each deployed row's greedy twins as the row finishes (`from_twins`), and a
generation of its own for every spec that had none (`generated`: formats whose rows cannot
carry twins, runs without the deployed protocol, resumed runs)."""
from __future__ import annotations

import sys
import time

from .results import stamp_matches


def reference(run, model, prompts, new_tokens: int) -> dict:
    """The unquantized model's greedy continuations of the prompts (once per run, kept in
    results.json's `fidelity`)."""
    from ..harness.fidelity import reference_continuations

    store = run.data.setdefault("fidelity", {})
    ref = store.get("reference")
    if ref is None or ref.get("new_tokens") != new_tokens or len(ref["tokens"]) != len(prompts):
        print(f"generation fidelity: reference continuations ({len(prompts)} prompts, {new_tokens} tokens) ...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        store["reference"] = reference_continuations(model, prompts, new_tokens)
        store["reference_wall_s"] = time.perf_counter() - t0
        run.save()
    return store["reference"]


def show(f: dict) -> None:
    print(f"fidelity {f['spec']:34s} seed={f['seed']} first diff mean {f['first_diff_mean']:5.1f} min "
          f"{f['first_diff_min']:3d}  match {f['match_rate']:.3f}  NLL/token {f['nll_per_token']:.3f} (reference "
          f"{f['ref_nll_per_token']:.3f})  steps {f['decode_mode']} ({f['source']})", file=sys.stderr, flush=True)


def from_twins(run, model, prompts, r: dict, continued: list, stamp: dict) -> None:
    """Fidelity figures of a deployed row's greedy twins: seed 0's as the spec's row of
    results.json's `fidelity` (the report's table), every seed's under `by_seed`."""
    from ..harness.fidelity import score_continuations

    store = run.data["fidelity"]
    t0 = time.perf_counter()
    try:
        f = score_continuations(model, prompts, continued, store["reference"], spec=r["spec"], seed=r["seed"],
                                decode_mode=r["decode_mode"], source="deployed twins")
    except Exception as e:  # noqa: BLE001 (keep the row; the fidelity stage generates this spec instead)
        print(f"fidelity {r['spec']} seed={r['seed']}: the twins' scoring failed ({type(e).__name__}: {e})",
              file=sys.stderr, flush=True)
        return
    f.update(stamp, wall_s=time.perf_counter() - t0)  # the scoring alone; the twins ran inside the row
    show(f)
    rows = store.setdefault("rows", {})
    if r["seed"] == 0:
        rows[r["spec"]] = {**f, "by_seed": rows.get(r["spec"], {}).get("by_seed", {})}
    seeds = rows.setdefault(r["spec"], {"spec": r["spec"], "error": "seed 0 not measured"}).setdefault("by_seed", {})
    seeds[str(r["seed"])] = {k: f[k] for k in ("first_diff_mean", "first_diff_min", "match_rate", "nll_per_token")}
    run.save()


def generated(run, model, prompts, specs, new_tokens: int, stamps: dict, cal_for=lambda spec, seed: None) -> None:
    """Generation fidelity per spec (seed 0) against the model's own cache over the run's
    window prompts (suites/harness/fidelity.py), into results.json's `fidelity`, for the
    specs whose deployed rows did not carry greedy twins (`from_twins`); resumable
    per spec, a failure recorded and the run goes on. A calibrated spec codes with the
    run's calibration (`cal_for`: fitted once per spec and seed, the one its seed-0
    perplexity rows used)."""
    from ..harness.fidelity import fidelity

    ref = reference(run, model, prompts, new_tokens)
    rows = run.data["fidelity"].setdefault("rows", {})
    for spec in specs:
        if spec in rows and "error" not in rows[spec] and stamp_matches(rows[spec], stamps[spec]):
            continue
        try:
            t0 = time.perf_counter()  # recorded: the fidelity pass is part of a GPU compare's time budget
            seeds = rows.get(spec, {}).get("by_seed")  # twins of later seeds' rows, if any ran
            rows[spec] = {**fidelity(model, prompts, spec, ref, calibration=cal_for(spec, 0)),
                          **stamps[spec], "wall_s": time.perf_counter() - t0, **({"by_seed": seeds} if seeds else {})}
            show(rows[spec])
        except Exception as e:  # noqa: BLE001 (keep what is measured; record the failure)
            rows[spec] = {"spec": spec, "error": f"{type(e).__name__}: {e}"}
        run.save()


__all__ = ["from_twins", "generated", "reference", "show"]
