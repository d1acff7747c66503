"""Streaming text comes out in whole characters, and stop strings are never partly shown."""

from __future__ import annotations

from pdserve.text.detokenizer import IncrementalDetokenizer, find_stop
from pdserve.text.tokenizer import Tokenizer


def test_streamed_text_equals_full_decode(tiny_model):
    tok = Tokenizer(tiny_model)
    text = "Plain words, café naïve 日本語 and an emoji 🚀 at the end."
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("The prompt")
    detok = IncrementalDetokenizer(tok, prompt, True)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_find_stop_reports_the_earliest():
    assert find_stop("hello world", 5, ("wor", "o w")) == ("o w", 4)
    assert find_stop("hello", 2, ("xyz",)) is None


def test_stop_string_is_cut_and_never_streamed(llm_tp1):
    from pdserve import SamplingParams
    base = llm_tp1.generate(["stop test"], SamplingParams(temperature=0, max_tokens=30))[0]
    text = base.outputs[0].text
    stop = text[10:13]
    engine = llm_tp1.engine
    engine.add_request("s", llm_tp1.tokenizer.encode("stop test"),
                       SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_text
            assert stop not in streamed
            if out.finished:
                assert out.finish_reason == "stop" and out.stop_reason == stop
    assert streamed == text[:text.index(stop)]
