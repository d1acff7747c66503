"""A `tokenizers` tokenizer rebuilt from a GGUF file's vocabulary (llama.cpp's metadata keys).

CLI process, at conversion time. Two vocabularies, as llama.cpp has them:
* `gpt2`: byte-level BPE from the tokens and merges, split before merging the way the model's
  `tokenizer.ggml.pre` names (llama.cpp's pre-tokenizer types; unknown ones split like GPT-2);
* `llama`: SentencePiece BPE with byte fallback, merges recovered from the token scores.
Tokens the file marks as control become special tokens; user-defined ones stay whole.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors


class UnsupportedTokenizerError(ValueError):
    pass


_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
           "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config.json contents) from the file's `tokenizer.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        tok = _sentencepiece(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                             meta.get("tokenizer.ggml.add_space_prefix", True))
    else:
        raise UnsupportedTokenizerError(f"GGUF tokenizer {kind!r} is not supported (gpt2, llama)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])

    def special(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokens.index(bos))])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": special("unknown_token_id"), "pad_token": special("padding_token_id"),
              "add_bos_token": add_bos, "model_max_length": meta.get("context_length")}
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, {k: v for k, v in config.items() if v is not None}


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=False))
    if pre == "smollm":  # digits one by one, then GPT-2's split (as SmolLM's own tokenizer)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], scores: list[float], add_space_prefix: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, _merges_from_scores(vocab, scores), unk_token=tokens[0],
                               byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1 if add_space_prefix else 0, 0)])
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece keeps scores, not merges: every split of a token into two tokens is a merge,
    ranked by the merged token's score (best first), ties by the halves' ids."""
    found = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[index], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]
