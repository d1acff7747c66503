"""The proxy's fan-out (fanout.py): a list of prompts split into one body each and the answers, whole
or streamed, merged with each choice at a single instance's index; a producer's prompt scores put
into decode's answer."""

from __future__ import annotations

import asyncio
import json

from pdserve.proxy.fanout import PromptScores, merge_answers, merge_streams, split_prompts, wants_scores


def test_a_list_of_prompts_is_split_and_one_prompt_is_not():
    body = {"prompt": ["a", "b"], "n": 2}
    assert split_prompts(body, "/v1/completions") == [{"prompt": "a", "n": 2}, {"prompt": "b", "n": 2}]
    assert split_prompts({"prompt": [[1, 2], [3]]}, "/v1/completions") == [{"prompt": [1, 2]}, {"prompt": [3]}]
    assert split_prompts({"prompt": [1, 2, 3]}, "/v1/completions") is None  # token ids of one prompt
    assert split_prompts({"prompt": ["a"]}, "/v1/completions") is None
    assert split_prompts({"messages": []}, "/v1/chat/completions") is None


def _answer(texts: list[str], prompt_tokens: int) -> dict:
    return {"id": "x", "object": "text_completion", "choices": [{"index": i, "text": t} for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(texts),
                      "total_tokens": prompt_tokens + len(texts), "prompt_tokens_details": {"cached_tokens": 1}}}


def test_answers_merge_in_prompt_order_with_usage_summed():
    merged = merge_answers([_answer(["a0", "a1"], 5), _answer(["b0", "b1"], 7)], n=2)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert merged["usage"] == {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
                               "prompt_tokens_details": {"cached_tokens": 2}}


async def _chunks(events: list[dict], split_at: int = 7):
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for i in range(0, len(raw), split_at):  # events cut anywhere, as a TCP stream may
        yield raw[i:i + split_at]
        await asyncio.sleep(0)


def test_streams_merge_with_indexes_moved_and_one_usage_event():
    def stream(prefix: str):
        return _chunks([{"id": prefix, "choices": [{"index": i, "text": f"{prefix}{i}"}]} for i in range(2)]
                       + [{"id": prefix, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}])

    async def run():
        return [e async for e in merge_streams([stream("a"), stream("b")], 2, include_usage=True)]
    events = asyncio.run(run())
    assert events[-1] == b"data: [DONE]\n\n"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    texts = {c["index"]: c["text"] for b in bodies for c in b["choices"]}
    assert texts == {0: "a0", 1: "a1", 2: "b0", 3: "b1"}
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 4}


def _producer_answer() -> dict:
    return {"object": "text_completion", "usage": {"prompt_tokens": 3},
            "choices": [{"index": 0, "prompt_logprobs": [None, {"5": {"logprob": -1.0}}, {"6": {"logprob": -2.0}}],
                         "logprobs": {"token_logprobs": [None, -1.0, -2.0, -0.5],
                                      "top_logprobs": [None, {"a": -1.0}, {"b": -2.0}, {"c": -0.5}]}}]}


def test_decodes_answer_gets_the_producers_prompt_scores():
    body = {"prompt": [1, 5, 6], "echo": True, "logprobs": 0, "prompt_logprobs": 0}
    assert wants_scores(body) and not wants_scores({"prompt": "x", "logprobs": 1})
    decode = {"object": "text_completion", "choices": [
        {"index": i, "prompt_logprobs": None,
         "logprobs": {"token_logprobs": [None, None, None, -0.5, -0.7], "top_logprobs": [None] * 3 + [{}, {}]}}
        for i in range(2)]}
    filled = PromptScores(_producer_answer(), body).fill(decode)
    for c in filled["choices"]:
        assert c["prompt_logprobs"] == _producer_answer()["choices"][0]["prompt_logprobs"]
        assert c["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.5, -0.7]
        assert c["logprobs"]["top_logprobs"][:3] == [None, {"a": -1.0}, {"b": -2.0}]


def test_a_streamed_answer_gets_them_in_each_choices_first_event():
    scores = PromptScores(_producer_answer(), {"prompt": [1, 5, 6], "prompt_logprobs": 0})
    events = [{"choices": [{"index": 0, "text": "x"}]}, {"choices": [{"index": 0, "text": "y"}]}]

    async def run():
        return [e async for e in scores.fill_stream(_chunks(events))]
    out = asyncio.run(run())
    bodies = [json.loads(e[6:]) for e in out if e.startswith(b"data: {")]
    assert bodies[0]["choices"][0]["prompt_logprobs"][2] == {"6": {"logprob": -2.0}}
    assert "prompt_logprobs" not in bodies[1]["choices"][0]
    assert out[-1].startswith(b"data: [DONE]")


def test_a_malformed_n_counts_as_one_and_is_left_to_the_instance_to_refuse():
    from pdserve.proxy.fanout import num_samples
    assert [num_samples({"n": v}) for v in (3, None, "0", "2", 0, -1, True, 2.0, [2])] == [3, 1, 1, 1, 1, 1, 1, 1, 1]
    assert num_samples({}) == 1
