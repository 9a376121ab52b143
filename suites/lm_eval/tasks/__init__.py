"""Offline lm-eval tasks built from the shipped corpora (no hub, no downloads past
the corpus the rest of the suite already uses).

    kvqbench_rolling   loglikelihood_rolling over fixed passages of the canterbury
                       corpus: word_perplexity, byte_perplexity, bits_per_byte
    kvqbench_passkey   generate_until: a five-digit "special magic number" buried in
                       a haystack of real text (Alice in Wonderland, whitespace
                       collapsed) at a spread of depths; the question comes last and
                       the first integer of the answer must equal it (exact_match)
    kvqbench_local     the group of both

The YAML files in this folder (`TASKS_DIR`, given to lm-eval as `include_path`)
point at the functions below, which build the documents on the fly from
`load_corpus("canterbury")`; the documents are a pure function of the corpus text
and the knobs, so every quantizer and every run sees the same ones.

Knobs (lm-eval `--metadata '{"passkey_chars": 2400}'` on the command line, or
`TaskManager(metadata=...)` from Python; defaults in brackets):
    rolling_docs [8], rolling_chars [2000]          passages and their length
    passkey_docs [20], passkey_chars [4800], passkey_seed [0]
        samples, haystack length in characters (~4.3 characters per token for
        SmolLM2's tokenizer: 4800 characters is about 1.1k tokens plus the prompt)

The prompt is the classic passkey-retrieval prompt (Mohtashami & Jaggi 2023) with
"special magic number" instead of "pass key": Alice has a golden key in it, and
SmolLM2-135M then answers "the pass key is a small golden key" even with an fp16
cache.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
TASK_NAMES = ("kvqbench_rolling", "kvqbench_passkey")
GROUP = "kvqbench_local"

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n\n")
NEEDLE = " The special magic number is {key}. Remember it. {key} is the special magic number. "
QUESTION = "\n\nWhat is the special magic number? The special magic number is"


def _int(kwargs: dict, key: str, default: int) -> int:
    value = kwargs.get(key)
    return default if value is None else int(value)


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def alice_text() -> str:
    """Alice's Adventures in Wonderland from the canterbury corpus, every run of
    whitespace collapsed to one space (the haystack reads as one long paragraph)."""
    from ...harness.corpora import load_corpus

    text, _ = load_corpus("canterbury")
    end = text.index("THE END") + len("THE END")  # alice29.txt comes first
    return " ".join(text[:end].split())


def _cut(text: str, start: int, n: int) -> str:
    """About n characters from `start`, beginning and ending on a word boundary."""
    if start > 0:
        sp = text.find(" ", start)
        start = sp + 1 if sp >= 0 else start
    piece = text[start:start + n]
    sp = piece.rfind(" ")
    return piece[:sp] if sp > n // 2 else piece


def rolling_docs(**kwargs):
    """`n` passages of ~`chars` characters, evenly spaced over the whole canterbury
    corpus (first at its start, last at its end), whitespace collapsed."""
    from ...harness.corpora import load_corpus

    n, chars = _int(kwargs, "rolling_docs", 8), _int(kwargs, "rolling_chars", 2000)
    text, _ = load_corpus("canterbury")
    text = " ".join(text.split())
    if n < 1 or chars < 16 or n * chars > len(text):
        raise ValueError(f"rolling_docs={n} x rolling_chars={chars} do not fit a corpus of {len(text)} characters")
    starts = [0] if n == 1 else [i * (len(text) - chars) // (n - 1) for i in range(n)]
    return _dataset([{"text": _cut(text, s, chars), "start": s} for s in starts])


def passkey_prompt(haystack: str, key: int, depth: float) -> str:
    """INTRO + haystack with the needle after the sentence nearest `depth` + QUESTION."""
    pos = int(len(haystack) * depth)
    dot = haystack.find(". ", pos)
    pos = dot + 2 if dot >= 0 else len(haystack)
    return INTRO + haystack[:pos] + NEEDLE.format(key=key).strip() + " " + haystack[pos:] + QUESTION


def passkey_docs(**kwargs):
    """`n` samples: a seeded five-digit key, a haystack of ~`chars` characters of Alice
    starting at an evenly spaced offset, the needle at depth frac(0.5 + 0.618 i) (so
    any prefix of the samples, e.g. lm-eval's --limit, spreads over depths)."""
    n, chars = _int(kwargs, "passkey_docs", 20), _int(kwargs, "passkey_chars", 4800)
    rng = random.Random(_int(kwargs, "passkey_seed", 0))
    alice = alice_text()
    if n < 1 or not 100 <= chars <= len(alice):
        raise ValueError(f"passkey_docs={n}, passkey_chars={chars}: need n >= 1 and 100 <= chars <= {len(alice)}")
    rows = []
    for i in range(n):
        key = rng.randint(10000, 99999)
        start = i * (len(alice) - chars) // max(n - 1, 1)
        depth = (0.5 + 0.6180339887 * i) % 1.0
        rows.append({"input": passkey_prompt(_cut(alice, start, chars), key, depth),
                     "answer": str(key), "depth": round(depth, 4), "start": start})
    return _dataset(rows)


def first_integer(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def passkey_process_results(doc: dict, results: list[str]) -> dict:
    """exact_match: the first integer of the generation equals the key."""
    return {"exact_match": float(first_integer(results[0]) == doc["answer"])}


__all__ = ["TASKS_DIR", "TASK_NAMES", "GROUP", "rolling_docs", "passkey_docs", "passkey_prompt",
           "passkey_process_results", "first_integer", "alice_text"]
