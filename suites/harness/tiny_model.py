"""A tiny random Llama (2 layers, head_dim 64, GQA 2/1) with a byte-level tokenizer,
saved as an ordinary Hugging Face folder: what tests of the command line, the
results file and the cache use where the real model is not what is tested. It
loads through `load_model(folder)` like any local model, in well under a second.
"""
from __future__ import annotations

from pathlib import Path


def make_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Write the tiny model + tokenizer into `folder` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # One token per byte: BPE over the 256 byte symbols with no merges.
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # same ids every run
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def tiny_corpus(path: Path, n_chars: int = 6000) -> Path:
    """A plain ASCII text file of about `n_chars` characters (one token per byte)."""
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
             "judge boxing matches near the old river bank").split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(n_chars // 5))
    Path(path).write_text(text[:n_chars], encoding="utf-8")
    return Path(path)


def tiny_compare_args(tiny: dict, out, *extra: str, specs: str = "fp16;int4") -> list[str]:
    """`kvqbench compare` arguments for a fast run on the tiny model (`tiny`: {"model":
    folder, "corpus": text file}): CPU, 2 windows of 32 tokens, one seed, run name "r"."""
    return ["compare", "--model", tiny["model"], "--corpus", tiny["corpus"], "--device", "cpu",
            "--window", "32", "--windows", "2", "--seeds", "1", "--specs", specs,
            "--out", str(out), "--run", "r", *extra]
