"""lm-evaluation-harness with the KV cache quantized by any registered quantizer.

The model class `KVQuantLM` is lm-eval's `HFLM` (registered as `kvqbench`) with
two methods replaced:

- `_model_call` (every loglikelihood, loglikelihood_rolling and multiple-choice
  request): each forward pass runs through a FRESH `QuantizedCache`, so every
  K/V that attention reads, the sequence's own prefill included, has been
  through quantize/dequantize: the `quantize-on-write` protocol of the PPL
  suite (METHOD.md 4), one sequence per write.
- `_model_generate` (generate_until): the generation engine
  (suites/harness/generate.py), batched: `batch_size` requests per call (lm-eval
  groups requests of the same generation settings); each row's left padding is
  stripped, rows of equal prompt length run as one batch; the prompt is one
  exact prefill (full-precision attention inside the prompt, K/V stored
  quantized: the deployed protocol), then graphed decode steps read the packed
  store (fused kernels where the format has one, on CUDA). Greedy or sampling
  (temperature, top_k, top_p), lm-eval's `until` strings and EOS per row. The
  tokens/s of every generation call is summed in `get_model_info()["kv_generation"]`
  and printed after each generate_until.

Loglikelihood runs one sequence per forward pass whatever `batch_size` says: a
padded batch would put padding tokens into the statistics of quantizers that group
over tokens (KIVI keys, per-channel int, Med3x), and each sequence must start from a
fresh cache. `quantizer=plain` runs the model's own cache (lm-eval's HFLM unchanged
for loglikelihood; generation through the engine over a StaticCache); `quantizer=fp16`
stores K/V as fp16 through the same quantized-cache path.

Python: `kvqbench.suites.lm_eval.evaluate` (`evaluate`, `task_scores`).

or lm-eval's own API with the class (`import kvqbench.suites.lm_eval.model`
registers `kvqbench`; give `TaskManager(include_path=TASKS_DIR)` for the
offline tasks):

    lm_eval.simple_evaluate(model="kvqbench",
                            model_args={"pretrained": "smollm2-135m", "quantizer": "int4"}, ...)

Command line: lm-eval 0.4.x finds models only in its own table or through
`@register_model` run in the same process (it reads no entry points for
models), so a bare `lm_eval --model kvqbench` cannot see this class.
`kvqbench-lm-eval` is lm-eval's command line, unchanged, with the class
registered and the offline tasks (`kvqbench.suites.lm_eval.tasks`) on
`--include_path`:

    kvqbench-lm-eval --model kvqbench --model_args pretrained=smollm2-135m,quantizer=int4,seed=0 \\
        --tasks kvqbench_local --device cpu
    kvqbench-lm-eval --model kvqbench --model_args "pretrained=smollm2-135m,quantizer=hqmq:S=96;r=4" ...

lm-eval splits model_args at every comma (its Python API even inside quotes), so a
spec's own options are written with ';' (`quantizer=hqmq:S=96;r=4`); a spec whose
options were split off at a comma (`quantizer=hqmq:S=96,r=4` arrives as
quantizer='hqmq:S=96' and r=4) is refused with a message saying so, never run with
`r` silently dropped. (`python -m kvqbench.suites.lm_eval.cli ...` is the same command; see cli.py.)
Model args: pretrained (embedded name, folder or hub id; `load_model`),
quantizer (spec, `plain` for none), seed (codebook seed), dtype (float32),
calibration_windows / calibration_corpus / calibration_tokens (a calibrated spec, e.g.
`quantizer=avq2-cal`: its codebooks are fitted once, at construction, on the fp16 K/V of
`calibration_windows` (default 2) windows of `calibration_tokens` (512, at most the
model's positions) tokens of `calibration_corpus` (default canterbury, the embedded
corpus; or a text file), contiguous and centred in it, away from its start where the
offline tasks' passkey haystack (Alice) reads; `get_model_info()["kv_calibration"]`
names the corpus and the token ranges. The offline kvqbench_rolling passages are
spread over canterbury too: give another calibration_corpus to keep them apart for
certain. calibration_windows=0 refuses a calibrated spec; from Python,
`calibration=` takes what `QuantizedCache(calibration=)` does, e.g. a compare run's),
attn_implementation (sdpa), plus HFLM's own (max_length, add_bos_token, ...). Any other
key is refused before the model loads, with the known ones listed: lm-eval passes every
model_arg on as a keyword, and HFLM would drop one it does not know (`spec=int4` for
`quantizer=int4` ran the default fp16 cache without a word).
"""
from __future__ import annotations

import inspect
import logging
import warnings

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ...quantizers import get_quantizer
from ..harness.generate import generate
from ..harness.kv_cache import QuantizedCache, cache_kwargs

log = logging.getLogger(__name__)
PLAIN = ("plain", "none", "")
MODEL_NAME = "kvqbench"


def _spec(quantizer, stray: dict | None = None) -> str | None:
    """The quantizer spec of model_args: quotes stripped, ';' between its options read as
    ','. `stray`: the other model_args; any that is an option of the spec's quantizer was
    split off the spec at a comma by lm-eval, and is refused rather than dropped."""
    import dataclasses

    from ...quantizers import QuantizerInputError, parse_spec

    if quantizer is None or str(quantizer).strip().lower() in PLAIN:
        return None
    spec = str(quantizer).strip()
    if len(spec) >= 2 and spec[0] == spec[-1] and spec[0] in "'\"":  # quoted on a command line
        spec = spec[1:-1]
    spec = spec.replace(";", ",")
    try:
        cls, _ = parse_spec(spec.strip("'\""))
    except QuantizerInputError:
        cls = None
    options = {f.name for f in dataclasses.fields(cls.Config)} if cls else set()
    split = {k: v for k, v in (stray or {}).items() if k in options}
    if split or spec[:1] in "'\"":  # a leading quote left alone: its closing one went with a split-off part
        whole = spec.strip("'\"") + "".join(f",{k}={str(v).strip(chr(39) + chr(34))}" for k, v in split.items())
        raise QuantizerInputError(
            f"model_args: quantizer={spec!r} with {', '.join(f'{k}={v}' for k, v in split.items()) or 'a stray quote'}"
            f" looks like the spec {whole!r} split at its commas (lm-eval splits model_args on ','). Write "
            f"its options with ';': quantizer={whole.replace(',', ';')}")
    get_quantizer(spec)  # a typo fails now, not inside the first forward pass
    return spec


def _device(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        # lm-eval's command line defaults to cuda:0; on a CPU machine run on the CPU.
        warnings.warn(f"device {device!r} requested but CUDA is not available: running on cpu", stacklevel=3)
        return "cpu"
    return device


class ModelArgsError(ValueError):
    """model_args KVQuantLM does not take; the message lists those it does."""


def known_args() -> list[str]:
    """Every model_arg KVQuantLM takes: its own and HFLM's named parameters (read from
    the installed lm-eval, so a new HFLM option is known without an edit here)."""
    names = set()
    for fn in (KVQuantLM.__init__, HFLM.__init__):
        names |= {n for n, p in inspect.signature(fn).parameters.items()
                  if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return sorted(names)


# HFLM options that act only when HFLM loads the model itself, which it never does here
# (load_model does): each would change the model evaluated, so one given is refused too.
_HFLM_LOADER_ONLY = ("revision", "subfolder", "peft", "delta", "autogptq", "gptqmodel", "gguf_file")


def _refuse_unknown(kwargs: dict) -> None:
    # HFLM's **kwargs reach only from_pretrained of a model it loads itself; it is always
    # given a loaded model here, so an unknown key would vanish.
    unknown = sorted(set(kwargs) - set(known_args()))
    if unknown:
        raise ModelArgsError(f"KVQuantLM: unknown model_args {', '.join(unknown)}; the known ones are "
                             f"{', '.join(known_args())} (the KV cache spec is quantizer=..., e.g. quantizer=int4)")
    unused = [k for k in _HFLM_LOADER_ONLY if kwargs.get(k) not in (None, False, "", "main")]
    if unused:
        raise ModelArgsError(f"KVQuantLM: model_args {', '.join(unused)} would be ignored: they act only when lm-eval "
                             "loads the model itself, and kvqbench loads it (give pretrained= a merged local folder)")


def _calibration_plan(spec, calibration, windows, tokens) -> tuple[int, int] | None:
    """None for a spec that needs no calibration; else (windows, tokens) checked, before
    the model loads: a calibrated spec with calibration_windows=0 (and no calibration=)
    is refused, naming the model_arg."""
    from collections.abc import Mapping

    from ..harness.calibration import spec_needs_calibration

    if not spec_needs_calibration(spec):
        return None
    if calibration is not None and not (isinstance(calibration, Mapping) and calibration):
        raise ModelArgsError(f"KVQuantLM: calibration= takes (layer, role) -> K/V or fitted tensors (Python), got "
                             f"{type(calibration).__name__}; on the command line use calibration_windows=N")
    try:
        windows, tokens = int(windows), int(tokens)
    except (TypeError, ValueError):
        raise ModelArgsError(f"KVQuantLM: calibration_windows and calibration_tokens must be whole numbers, got "
                             f"{windows!r}, {tokens!r}") from None
    if calibration is None and windows < 1:
        raise ModelArgsError(f"KVQuantLM: quantizer={spec} is a calibrated quantizer (fitted once per model on "
                             f"calibration K/V) and calibration_windows={windows} gives it none: use "
                             "calibration_windows=N (N >= 1 windows of calibration_corpus, default 2)")
    if calibration is None and tokens < 2:
        raise ModelArgsError(f"KVQuantLM: calibration_tokens must be >= 2, got {tokens}")
    return windows, tokens


def _merged_batch_size(args: dict, extra: dict) -> dict:
    """model_args' batch_size against lm-eval's `--batch_size` (popped from `extra`): one
    given, or both equal, or the flag at lm-eval's default 1, is taken; two different
    values are refused, naming both."""
    if "batch_size" not in args or "batch_size" not in extra:
        return args
    flag = extra.pop("batch_size")
    if str(flag) not in ("1", str(args["batch_size"])):
        raise ModelArgsError(f"KVQuantLM: batch_size given twice: model_args batch_size={args['batch_size']} and "
                             f"--batch_size {flag}; give one")
    return args


@register_model(MODEL_NAME)
class KVQuantLM(HFLM):
    """HFLM whose KV cache is quantized by `quantizer` (a kvqbench spec); see the module doc."""

    # lm-eval's command line always passes its own `--batch_size` (default 1) beside the
    # model_args, so `model_args=...,batch_size=8` alone raised "got multiple values for
    # keyword argument 'batch_size'" (seen on the H200, 2026-12-05): merged here instead.
    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval import utils

        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**_merged_batch_size(dict(arg_dict), extra), **extra)

    def __init__(self, pretrained="smollm2-135m", quantizer: str = "fp16", seed: int = 0, *,
                 tokenizer=None, device: str | None = None, dtype: str = "float32",
                 attn_implementation: str = "sdpa", batch_size=1, calibration=None,
                 calibration_windows=2, calibration_corpus: str = "canterbury", calibration_tokens=512,
                 **kwargs):
        self.spec = _spec(quantizer, kwargs)  # first: it names a spec's options split off at a comma
        _refuse_unknown(kwargs)
        self.kv_seed = int(seed)
        cal_plan = _calibration_plan(self.spec, calibration, calibration_windows, calibration_tokens)
        if isinstance(pretrained, str):
            from ..harness.models import load_model

            torch_dtype = getattr(torch, str(dtype).removeprefix("torch.")) if not isinstance(dtype, torch.dtype) else dtype
            model, loaded_tok, self.kv_model_info = load_model(
                pretrained, device=_device(device), dtype=torch_dtype, attn_implementation=attn_implementation)
            tokenizer = tokenizer or loaded_tok
        else:  # an already loaded transformers model (kvqbench compare reuses its own)
            if tokenizer is None:
                raise ValueError("KVQuantLM: pass tokenizer= together with a model object")
            model = pretrained
            self.kv_model_info = {"name": getattr(model.config, "_name_or_path", "") or type(model).__name__}
        try:
            self.kv_gen_batch = int(batch_size)
        except ValueError:
            raise ModelArgsError(f"KVQuantLM: batch_size must be a positive int (generation batches; loglikelihood "
                                 f"runs one sequence per cache), got {batch_size!r}") from None
        if self.kv_gen_batch < 1:
            raise ModelArgsError(f"KVQuantLM: batch_size must be >= 1, got {batch_size!r}")
        for ignored in ("max_batch_size", "parallelize", "tp_plan"):
            if kwargs.get(ignored) not in (None, False):
                warnings.warn(f"KVQuantLM: {ignored}={kwargs[ignored]!r} ignored", stacklevel=2)
            kwargs.pop(ignored, None)
        # HFLM logs a warning for a model object; it is the intended path here.
        hf_log = logging.getLogger("lm_eval.models.huggingface")
        level = hf_log.level
        hf_log.setLevel(logging.ERROR)
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1, **kwargs)
        finally:
            hf_log.setLevel(level)
        self.kv_name = pretrained if isinstance(pretrained, str) else self.kv_model_info["name"]
        self.kv_nbytes = 0
        self.kv_numel = 0
        self.kv_calls = {"forward": 0, "generate": 0}
        self.kv_generation = {"new_tokens": 0, "seconds": 0.0, "calls": 0, "modes": []}
        self.kv_calibration, self.kv_calibration_info = None, None
        if cal_plan is not None:
            self._calibrate(calibration, *cal_plan, calibration_corpus)

    def _calibrate(self, given, n_windows: int, tokens: int, corpus: str) -> None:
        """A calibrated spec's calibration, fitted once for every cache of this model: the
        one given, else captured from `n_windows` windows of `corpus` (named in the info)."""
        from ..harness.calibration import corpus_calibration, fit_calibration
        from ..harness.corpora import load_corpus

        if given is not None:
            info = {"source": "given by the caller (calibration=)"}
        else:
            try:
                text, corpus_info = load_corpus(corpus)
            except (ValueError, OSError) as e:
                raise ModelArgsError(f"KVQuantLM: calibration_corpus={corpus!r}: {e}") from None
            limit = getattr(self.model.config, "max_position_embeddings", None)
            tokens = min(tokens, limit) if isinstance(limit, int) and limit > 0 else tokens
            try:
                given, info = corpus_calibration(self.model, self.tokenizer, text, n_windows, tokens)
            except ValueError as e:
                raise ModelArgsError(f"KVQuantLM: calibration_windows={n_windows} x calibration_tokens={tokens} "
                                     f"of calibration_corpus={corpus!r}: {e}") from None
            info = {"corpus": {k: corpus_info.get(k) for k in ("name", "sha256")}, **info}
            log.warning("kvqbench: %s calibrated on %d window(s) of %d tokens of %s, token ranges %s",
                        self.spec, n_windows, info["tokens"], corpus_info.get("name"), info["ranges"])
        self.kv_calibration = fit_calibration(self.spec, given, self.kv_seed,
                                              device=next(self.model.parameters()).device)
        self.kv_calibration_info = info

    # ---- the two replaced methods ---------------------------------------------------
    def _new_cache(self) -> QuantizedCache:
        return QuantizedCache(self.spec, config=self.model.config, seed=self.kv_seed,
                              calibration=self.kv_calibration)

    def _count(self, cache: QuantizedCache) -> None:
        self.kv_nbytes += cache.cache_nbytes()  # model constants apart (quantizers/base.py)
        self.kv_numel += cache.numel()

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if self.spec is None or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask, labels)
        out = []
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            for row in inps.split(1):  # one sequence per fresh cache (batch is 1 anyway)
                cache = self._new_cache()
                out.append(self.model(input_ids=row, **cache_kwargs(self.model, cache), use_cache=True).logits)
                self._count(cache)
                self.kv_calls["forward"] += 1
        return torch.cat(out)

    def generate_until(self, requests, disable_tqdm: bool = False):
        """HFLM's, with `batch_size` requests per engine call (loglikelihood keeps 1)."""
        saved = self.batch_size_per_gpu
        self.batch_size_per_gpu = self.kv_gen_batch
        before = dict(self.kv_generation)
        try:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = saved
            n = self.kv_generation["new_tokens"] - before["new_tokens"]
            sec = self.kv_generation["seconds"] - before["seconds"]
            if n:
                log.warning("kvqbench generate_until: %d new tokens in %.2f s (%.1f tokens/s), %s, steps: %s",
                            n, sec, n / sec if sec else float("nan"), self.spec or "plain",
                            "+".join(sorted(set(self.kv_generation["modes"]))))

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """The engine (module docstring); returns what HFLM's does: the (left-padded)
        context followed by each row's new tokens, right-padded with the pad id."""
        mask = generation_kwargs.pop("attention_mask", None)
        do_sample = generation_kwargs.pop("do_sample", None)
        temperature = float(generation_kwargs.pop("temperature", 0.0) or 0.0)
        top_k, top_p = generation_kwargs.pop("top_k", None), generation_kwargs.pop("top_p", None)
        for harmless in ("use_cache", "pad_token_id"):
            generation_kwargs.pop(harmless, None)
        if generation_kwargs:
            raise ValueError(f"KVQuantLM generation does not take {sorted(generation_kwargs)} "
                             "(it runs greedy or sampling with temperature / top_k / top_p)")
        if do_sample is False:
            temperature = 0.0
        elif do_sample and temperature == 0.0:
            temperature = 1.0
        rows = [r[m.bool()].tolist() for r, m in zip(context, mask)] if mask is not None else context.tolist()
        out = generate(self.model, rows, self.spec, max_new_tokens=max_length - context.shape[1],
                       tokenizer=self.tokenizer, stop=[s for s in stop if s], temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=self.kv_seed,
                       eos_token_id=self.tokenizer.eos_token_id, calibration=self.kv_calibration)
        self.kv_nbytes += out.cache_nbytes
        self.kv_numel += out.cache_elements
        self.kv_calls["generate"] += len(rows)
        g = self.kv_generation
        g["new_tokens"] += out.new_tokens
        g["seconds"] += out.prefill_s + out.decode_s
        g["calls"] += 1
        g["modes"].append(out.mode)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        width = max(map(len, out.tokens))
        new = torch.tensor([t + [pad] * (width - len(t)) for t in out.tokens], dtype=torch.long, device=context.device)
        return torch.cat([context, new], 1)

    # ---- reporting ------------------------------------------------------------------
    def bits_per_element(self) -> float:
        """Measured over every cache this model ran: the caches' own stored bytes (model
        constants, e.g. seeded rotations, apart: quantizers/base.py) x 8 / K/V elements."""
        return self.kv_nbytes * 8 / self.kv_numel if self.kv_numel else float("nan")

    def get_model_info(self) -> dict:
        # HFLM's version asks the hub for a commit sha; this one stays offline.
        info = {k: v for k, v in self.kv_model_info.items() if k in
                ("name", "source", "sha256", "sha256_verified", "weights_sha256", "n_layers", "n_heads",
                 "n_kv_heads", "head_dim", "note")}
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_revision": None,
            "model_sha": info.get("sha256"),
            "kvqbench_model": info,
            "kv_quantizer": self.spec or "plain",
            "kv_seed": self.kv_seed,
            "kv_calibration": self.kv_calibration_info,
            "kv_bits_per_element": self.bits_per_element() if self.spec else None,
            "kv_calls": dict(self.kv_calls),
            "kv_generation": dict(self.kv_generation, modes=sorted(set(self.kv_generation["modes"])),
                                  tokens_per_s=(self.kv_generation["new_tokens"] / self.kv_generation["seconds"]
                                                if self.kv_generation["seconds"] else None),
                                  batch_size=self.kv_gen_batch),
            "kv_protocol": {"loglikelihood": "quantize-on-write (fresh cache per sequence)",
                            "generate_until": "deployed: exact prefill, then decode steps through the engine "
                                              "(suites/harness/generate.py)"},
        }


__all__ = ["KVQuantLM", "MODEL_NAME", "ModelArgsError", "known_args"]
