"""A request's structured-output constraint as one llguidance grammar, checked without a tokenizer.

Server process (validation, so a bad schema is a 400 naming its field) and TP rank 0 (the same text,
compiled against the vocabulary by matchers.py). Pure functions of (kind, value); cached by them.
"""

from __future__ import annotations

import functools
import json

from pdserve.sampling_params import InvalidRequestError, StructuredOutputs

# Compact JSON (no optional whitespace): a model that is unsure may otherwise emit whitespace until
# max_tokens, as vLLM's `disable_any_whitespace` option exists to prevent.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT = {"type": "object"}


def grammar_text(structured: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) for this constraint; InvalidRequestError naming
    `structured.field` when it is not a valid schema, regex or grammar."""
    try:
        text = _grammar_text(structured.kind, structured.value)
    except ValueError as e:
        raise InvalidRequestError(structured.field, f"is not a valid {structured.kind}: {e}") from None
    return text


@functools.lru_cache(maxsize=256)
def _grammar_text(kind: str, value: str) -> str:
    from llguidance import LLMatcher
    if kind == "json":
        text = LLMatcher.grammar_from_json_schema(json.loads(value), defaults=_JSON_OPTIONS)
    elif kind == "json_object":
        text = LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
    elif kind == "regex":
        text = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        choices = json.loads(value)
        text = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    elif kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            lark = any_to_lark(value)  # vLLM's guided_grammar is GBNF (xgrammar) or Lark (guidance)
        except Exception as e:  # noqa: BLE001 - the converter's parse errors have no common type
            raise ValueError(str(e)) from None
        text = LLMatcher.grammar_from_lark(lark)
    else:
        raise AssertionError(f"unknown structured-output kind {kind!r}")
    error = LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(error)
    return text
