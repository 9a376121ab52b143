"""Running lm-eval with a quantized KV cache from Python: `evaluate` (tasks on a model
under any registered quantizer), `task_scores` (lm-eval's results flattened to
{task: {metric: value}}) and `compare_scores` (what `kvqbench compare --lm-eval`
stores on a result record). The model class is `model.KVQuantLM`.

    from kvqbench.suites.lm_eval.evaluate import evaluate, task_scores
    res = evaluate(["kvqbench_passkey"], quantizer="hqmq:S=96,r=4", limit=5)
    task_scores(res)   # {"kvqbench_passkey": {"exact_match": 1.0, ...}}
"""
from __future__ import annotations

import contextlib

import torch

from .model import KVQuantLM

_TASK_MANAGERS: dict = {}


def task_manager(metadata: dict | None = None, tasks=None):
    """lm-eval TaskManager with the offline kvqbench tasks on its include path. lm-eval's
    own tasks (thousands of YAMLs: ~10-40 s to index) are indexed only when `tasks`
    names one of them (or is None); managers are reused per (defaults, metadata)."""
    import json

    from lm_eval.tasks import TaskManager

    from .tasks import GROUP, TASK_NAMES, TASKS_DIR

    defaults = tasks is None or not set(tasks) <= {*TASK_NAMES, GROUP}
    key = (defaults, json.dumps(metadata, sort_keys=True, default=str))
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = TaskManager(include_path=str(TASKS_DIR), include_defaults=defaults,
                                          metadata=metadata)
    return _TASK_MANAGERS[key]


def evaluate(tasks, quantizer: str = "fp16", pretrained="smollm2-135m", *, tokenizer=None, seed: int = 0,
             limit=None, metadata: dict | None = None, device: str | None = None, lm: KVQuantLM | None = None,
             **simple_evaluate_kwargs) -> dict:
    """Run lm-eval `tasks` (names or a comma-separated string; hub tasks too where the hub
    is reachable) with the KV cache quantized by `quantizer`; returns lm-eval's results
    dict. `pretrained` may be a name (loaded with `load_model`) or a model object (then
    give `tokenizer`); `lm` reuses a KVQuantLM. `metadata` sets task knobs
    (kvqbench.suites.lm_eval.tasks)."""
    import lm_eval

    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    if lm is None:
        lm = KVQuantLM(pretrained=pretrained, tokenizer=tokenizer, quantizer=quantizer, seed=seed, device=device)
    simple_evaluate_kwargs.setdefault("log_samples", False)
    simple_evaluate_kwargs.setdefault("verbosity", "WARNING")
    with _brief_env_info():
        return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager(metadata, tasks),
                                       limit=limit, **simple_evaluate_kwargs)


@contextlib.contextmanager
def _brief_env_info():
    """lm-eval records torch's collect_env report (pip list, nvidia-smi, ...: seconds)
    with every evaluation; `evaluate` records versions only. The command line is unchanged."""
    import lm_eval.evaluator as ev

    original = getattr(ev, "add_env_info", None)

    def brief(storage: dict) -> None:
        import lm_eval
        import transformers

        storage.update({"pretty_env_info": "not collected (kvqbench.suites.lm_eval.evaluate.evaluate)",
                        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
                        "lm_eval_version": lm_eval.__version__})

    if original is not None:
        ev.add_env_info = brief
    try:
        yield
    finally:
        if original is not None:
            ev.add_env_info = original


def task_scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results (filter suffixes like ',none'
    dropped; stderr kept as '<metric>_stderr'; groups included)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name, _, flt = key.partition(",")
            row[name if flt in ("", "none") else f"{name},{flt}"] = float(value)
        out[task] = row
    return out


COMPARE_BATCH = 8  # generation requests per engine call under `compare --lm-eval` (loglikelihood: one each)


def compare_scores(model, tokenizer, spec: str, seed: int, tasks: str, limit=None, metadata=None,
                   calibration=None) -> dict:
    """What `kvqbench compare --lm-eval TASKS` stores on a result record: the task
    scores of `spec` on an already loaded model, and the bits its caches stored
    (`calibration`: a calibrated spec's, the compare run's; see KVQuantLM)."""
    import time

    t0 = time.perf_counter()
    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer=spec, seed=seed, calibration=calibration,
                   batch_size=COMPARE_BATCH)
    res = evaluate(tasks, lm=lm, limit=limit, metadata=metadata)
    return {"requested": [tasks, limit, metadata], "scores": task_scores(res),
            "n_samples": {t: v.get("effective", v.get("original")) for t, v in res.get("n-samples", {}).items()},
            "bits_per_element": lm.bits_per_element(), "kv_calls": dict(lm.kv_calls),
            # tokens, seconds, tokens/s, modes, batch_size (requests per engine call)
            "kv_generation": dict(lm.get_model_info().get("kv_generation") or {}),
            "lm_eval_version": res.get("lm_eval_version"), "wall_s": time.perf_counter() - t0}


__all__ = ["evaluate", "task_scores", "task_manager", "compare_scores"]
