"""A request's structured-output fields, in any of the shapes vLLM accepts, as one constraint.

Server process, HTTP edge. OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`: at most one of them per request. The constraint
is checked here (structured/grammar.py), so a bad schema is a 400 that names its field.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.sampling_params import InvalidRequestError, StructuredOutputs
from pdserve.structured.grammar import grammar_text

_KINDS = ("json", "regex", "choice", "grammar")
_ATTR = {"json": "json_"}  # protocol.StructuredOutputsParams: `json` would shadow pydantic's method


def structured_outputs(req) -> StructuredOutputs | None:
    found = [s for s in (_response_format(req), *_vllm_fields(req)) if s is not None]
    if len(found) > 1:
        raise InvalidRequestError(found[1].field, f"conflicts with {found[0].field}: a request takes "
                                                  f"one structured-output constraint")
    if found:
        grammar_text(found[0])  # raises naming the field
    return found[0] if found else None


def json_schema(schema: Any, field: str) -> StructuredOutputs:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "must be a JSON schema (an object)")
    return StructuredOutputs("json", json.dumps(schema, sort_keys=True), field)


def _response_format(req) -> StructuredOutputs | None:
    rf = getattr(req, "response_format", None)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputs("json_object", "", "response_format")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise InvalidRequestError("response_format.json_schema", "must give a schema")
        return json_schema(rf.json_schema.json_schema, "response_format.json_schema.schema")
    raise InvalidRequestError("response_format.type", f"{rf.type!r} is not supported by pdserve "
                                                      f"(text, json_object, json_schema)")


def _vllm_fields(req):
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        given = [k for k in (*_KINDS, "json_object") if getattr(so, _ATTR.get(k, k)) not in (None, False)]
        if len(given) > 1:
            raise InvalidRequestError(f"structured_outputs.{given[1]}", f"conflicts with {given[0]}")
        if so.structural_tag is not None:
            raise InvalidRequestError("structured_outputs.structural_tag", "is not supported by pdserve")
        for kind in given:
            yield _one(kind, getattr(so, _ATTR.get(kind, kind)), f"structured_outputs.{kind}")
    for kind in _KINDS:
        value = getattr(req, f"guided_{kind}", None)
        if value is not None:
            yield _one(kind, value, f"guided_{kind}")


def _one(kind: str, value: Any, field: str) -> StructuredOutputs:
    if kind == "json_object":
        return StructuredOutputs("json_object", "", field)
    if kind == "json":
        return json_schema(value, field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(field, "must be a non-empty list of strings")
        return StructuredOutputs("choice", json.dumps(value), field)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(field, "must be a non-empty string")
    return StructuredOutputs(kind, value, field)
