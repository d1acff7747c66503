"""Structured outputs without processes: the sampler's grammar mask on random logits (the tiny model's
vocabulary), a matcher resumed after a P/D producer's first token, and the request fields' errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from pdserve.sampling_params import InvalidRequestError, StructuredOutputs
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server.structured import structured_outputs
from pdserve.structured.matchers import Matchers
from pdserve.text.tokenizer import Tokenizer
from pdserve.worker.messages import GrammarSpec, SamplingSpec
from pdserve.worker.sampler import Sampler

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "ok": {"type": "boolean"}}}


def generate(tiny_model, grammar: GrammarSpec, seed: int, max_tokens: int = 200) -> tuple[str, list[int]]:
    tok = Tokenizer(tiny_model)
    sampler = Sampler(tok.vocab_size, Matchers(tiny_model, tok.vocab_size, (tok.eos_token_id,)))
    sampler.add("r", SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, seed=seed, num_logprobs=None,
                                  grammar=grammar))
    g = torch.Generator().manual_seed(seed)
    tokens = list(grammar.prefix_ids)
    for _ in range(max_tokens):
        token = sampler.sample(torch.randn(1, tok.vocab_size, generator=g) * 5, ["r"])[0].token_id
        if token == tok.eos_token_id:
            return tok.decode(tokens), tokens
        tokens.append(token)
    raise AssertionError(f"no end of sequence after {max_tokens} tokens: {tok.decode(tokens)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_follow_a_json_schema(tiny_model, seed):
    text, _ = generate(tiny_model, GrammarSpec("json", json.dumps(SCHEMA)), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_grammar(tiny_model):
    import re
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", generate(tiny_model, GrammarSpec("regex", "[a-c]{3}-[0-9]{2}"), 0)[0])
    assert generate(tiny_model, GrammarSpec("choice", json.dumps(["yes", "no"])), 1)[0] in ("yes", "no")
    gbnf = 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'
    assert re.fullmatch(r"\(\d+ \+ \d+\)", generate(tiny_model, GrammarSpec("grammar", gbnf), 2)[0])


def test_a_consumer_resumes_after_the_producers_first_token(tiny_model):
    """P/D: decode rebuilds the matcher and advances it by the first token the producer drew."""
    _, tokens = generate(tiny_model, GrammarSpec("json", json.dumps(SCHEMA)), 5)
    text, _ = generate(tiny_model, GrammarSpec("json", json.dumps(SCHEMA), prefix_ids=tokens[:3]), 6)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_requests_without_a_grammar_are_not_masked(tiny_model):
    tok = Tokenizer(tiny_model)
    sampler = Sampler(tok.vocab_size, Matchers(tiny_model, tok.vocab_size, (tok.eos_token_id,)))
    sampler.add("free", SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None, num_logprobs=None))
    sampler.add("json", SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None, num_logprobs=None,
                                     grammar=GrammarSpec("json", json.dumps(SCHEMA))))
    logits = torch.zeros(2, tok.vocab_size)
    logits[:, 300] = 10.0  # not '{'
    out = sampler.sample(logits, ["free", "json"])
    assert out[0].token_id == 300
    assert tok.decode([out[1].token_id]).startswith("{")


def completion(**fields):
    return CompletionRequest(prompt="x", **fields)


@pytest.mark.parametrize("fields,kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                 "strict": True}}}, "json"),
    ({"structured_outputs": {"json": SCHEMA}}, "json"),
    ({"structured_outputs": {"regex": "a+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, "grammar"),
    ({"guided_json": json.dumps(SCHEMA)}, "json"),
    ({"guided_regex": "a+"}, "regex"),
    ({"guided_choice": ["a"]}, "choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar"),
    ({"response_format": {"type": "text"}}, None),
])
def test_every_shape_of_the_fields(fields, kind):
    s = structured_outputs(completion(**fields))
    assert (s.kind if s else None) == kind
    assert structured_outputs(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)) == s


@pytest.mark.parametrize("fields,field", [
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}},
     "structured_outputs.json"),
    ({"guided_regex": "a(("}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
])
def test_a_bad_constraint_names_its_field(fields, field):
    with pytest.raises(InvalidRequestError) as e:
        structured_outputs(completion(**fields))
    assert e.value.field == field


def test_kind_is_checked():
    with pytest.raises(InvalidRequestError):
        StructuredOutputs("yaml", "", "x")
    assert structured_outputs(SimpleNamespace()) is None
