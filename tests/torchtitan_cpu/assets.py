"""The test assets torchtitan's debug configs read from ``./tests/assets`` (not in the wheel):
a synthetic c4-style JSON-lines data set and a small word-level HF tokenizer (ids < 2048, the
debug model's vocabulary)."""

from __future__ import annotations

import json
import os
import random

N_WORDS = 1000
N_LINES = 2000


def _words() -> list[str]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    seen: set[str] = set()
    while len(seen) < N_WORDS:
        seen.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))))
    return sorted(seen)


def make(workdir: str) -> str:
    """Write ``workdir/tests/assets/{c4_test/data.json,tokenizer/}``; returns workdir."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = _words()
    data_dir = os.path.join(workdir, "tests", "assets", "c4_test")
    tok_dir = os.path.join(workdir, "tests", "assets", "tokenizer")
    os.makedirs(data_dir, exist_ok=True)
    os.makedirs(tok_dir, exist_ok=True)

    rng = random.Random(1)
    with open(os.path.join(data_dir, "data.json"), "w") as f:
        for _ in range(N_LINES):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 200)))
            f.write(json.dumps({"text": text}) + "\n")

    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials[1:])
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "add_bos_token": True, "add_eos_token": True}, f)
    return workdir
