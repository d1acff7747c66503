"""Train, offline and deterministically, the byte-level BPE tokenizer that generated models ship with.

Runs in `pdserve make-model` only. The training text is generated from a seed: pseudo-words, some
English, digits, punctuation and multi-byte characters, so detokenization of split UTF-8 is exercised.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# A documented default chat template (role markers are special tokens of this tokenizer).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_ENGLISH = (
    "the of and to in is that it for on with as was at by be this from or have an are not but "
    "what all were when we there can your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much before go good new "
    "write our used me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet "
    "land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let "
    "night following picture being study second eyes soon times story boys since white days ever "
    "paper hard near sentence better best across during today others however sure means knew "
    "prefill decode cache block token server request model tensor parallel transfer engine"
).split()
_EXTRA = ["café", "naïve", "über", "niño", "日本語", "中文", "你好", "ü", "€", "→", "😀", "🚀", "✓"]
_PUNCT = [".", ",", "!", "?", ";", ":", "-", "(", ")", "'", '"', "\n"]


def _corpus(seed: int, num_words: int) -> list[str]:
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]
    pseudo = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(4000)]
    lines, words = [], []
    for _ in range(num_words):
        r = rng.random()
        if r < 0.55:
            w = rng.choice(_ENGLISH)
        elif r < 0.9:
            w = rng.choice(pseudo)
        elif r < 0.95:
            w = str(rng.randint(0, 10 ** rng.randint(1, 6)))
        else:
            w = rng.choice(_EXTRA)
        if rng.random() < 0.1:
            w = w.capitalize()
        words.append(w)
        if rng.random() < 0.12:
            words[-1] += rng.choice(_PUNCT)
        if len(words) > 12 and rng.random() < 0.08:
            lines.append(" ".join(words))
            words = []
    lines.append(" ".join(words))
    return lines


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, num_words=40 * vocab_size), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    return tok


def write_tokenizer(tok: Tokenizer, out_dir: Path, max_len: int) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
