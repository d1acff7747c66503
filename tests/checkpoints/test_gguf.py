"""GGUF checkpoints: files written with the `gguf` library (llama.cpp's layout) from generated and
transformers-written models, in the Llama, Qwen2, Qwen3 and Mistral families, load in pdserve and in
transformers' GGUF loader, and the greedy answers are equal."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gguf_writer import write_gguf
from helpers import assert_greedy_match, hf_reference
from pdserve import LLM, SamplingParams
from pdserve.checkpoints.gguf_file import GGUFError, checkpoint_dir

CASES = [("tiny", "Q8_0"), ("tiny", "Q4_1"), ("tiny", "Q4_0"), ("tiny", "F16"), ("llama-256", "Q6_K"),
         ("qwen2", "Q8_0"), ("qwen3-hd128", "Q4_1"), ("mistral", "Q8_0")]


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def source(kind: str, tiny_model: str, hf_checkpoint) -> str:
    return tiny_model if kind == "tiny" else hf_checkpoint(kind)


@pytest.mark.parametrize("kind, qtype", CASES, ids=[f"{k}-{q}" for k, q in CASES])
def test_greedy_answers_equal_transformers_gguf_loader(kind, qtype, tiny_model, hf_checkpoint, gguf_dir):
    src = source(kind, tiny_model, hf_checkpoint)
    path = write_gguf(src, gguf_dir / f"{kind}-{qtype}.gguf", qtype, name=f"tiny {kind}")
    # Dequantized, as transformers' loader does: this compares the reading of the file token for token
    # (kept quantized, activations are rounded too: test_gguf_quant.py bounds that difference).
    llm = LLM(str(path), num_threads=1, num_blocks=64, download_dir=str(gguf_dir / "cache"),
              quantization="none")
    try:
        for seed in (1, 2):
            ids = prompt(seed)
            ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
            ref = hf_reference(str(gguf_dir), ids, 12, gguf_file=path.name)
            assert_greedy_match(ours, ref, f"gguf {kind} {qtype}")
    finally:
        llm.shutdown()


def test_the_tokenizer_and_chat_template_come_from_the_file(tiny_model, gguf_dir):
    from pdserve.text.tokenizer import Tokenizer
    path = write_gguf(tiny_model, gguf_dir / "tok.gguf", "Q8_0")
    converted = checkpoint_dir(str(path), gguf_dir / "cache")
    ours, original = Tokenizer(converted), Tokenizer(tiny_model)
    for text in ("The prefill server sends 1234 blocks", "  spaced\n\nlines, and <|eos|> too"):
        assert ours.encode(text) == original.encode(text)
        assert ours.decode(ours.encode(text)) == original.decode(original.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == original.apply_chat_template(messages)
    assert ours.eos_token_id == original.eos_token_id
    assert checkpoint_dir(str(path), gguf_dir / "cache") == converted  # converted once


def test_what_cannot_be_served_is_named(tiny_model, gguf_dir):
    import gguf
    path = gguf_dir / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        checkpoint_dir(str(path), gguf_dir / "cache")
    assert not list((gguf_dir / "cache").glob(".*tmp"))  # nothing half-written left behind
    assert json.loads((Path(checkpoint_dir(str(write_gguf(tiny_model, gguf_dir / "ok.gguf")),
                                           gguf_dir / "cache")) / "config.json").read_text())[
        "architectures"] == ["LlamaForCausalLM"]
