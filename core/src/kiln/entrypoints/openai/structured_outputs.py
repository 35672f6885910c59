"""A request's decoding constraint, however the client spells it: vLLM's ``structured_outputs``
object, its older ``guided_*`` fields, or OpenAI's ``response_format``.

A request carries at most one constraint; two (in any spellings) are a 400 that names both. The
options of ``structured_outputs`` (``disable_fallback``, ``disable_any_whitespace``,
``disable_additional_properties``, ``whitespace_pattern``) shape whichever constraint is given.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kiln.entrypoints.openai.protocol import APIError, ResponseFormat, SamplingFields, StructuredOutputs
from kiln.interfaces.guided import KINDS, GuidedDecodingParams

_LEGACY_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"))  # fmt: skip

# Where a JSON schema holds subschemas: maps of them, and single ones or lists of them.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "allOf", "anyOf", "oneOf", "not",
               "if", "then", "else", "contains")  # fmt: skip

Given = dict[str, tuple[str, Any]]  # the field as the client wrote it -> (constraint kind, spec)


def request_constraint(req: SamplingFields) -> GuidedDecodingParams | None:
    """The request's constraint, or None. ``APIError`` for two constraints; ``ValueError`` (naming
    the field) for a malformed one."""
    given: Given = {name: (kind, getattr(req, name)) for name, kind in _LEGACY_FIELDS}
    given = {name: value for name, value in given.items() if value[1] is not None}
    given.update(_from_response_format(req.response_format))
    if req.structured_outputs is not None:
        given.update(_from_structured_outputs(req.structured_outputs))
    return _build(given, req.structured_outputs, req.guided_decoding_backend, req.guided_whitespace_pattern)


def structured_outputs_constraint(options: StructuredOutputs) -> GuidedDecodingParams:
    """The constraint of a bare ``structured_outputs`` object (``/generate``)."""
    return _build(_from_structured_outputs(options), options)


def _from_response_format(fmt: ResponseFormat | None) -> Given:
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": ("json_object", True)}
    if fmt.type == "structural_tag":
        tag = fmt.model_dump(include={"type", "format", "structures", "triggers"}, exclude_none=True)
        return {"response_format": ("structural_tag", tag)}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError("response_format: json_schema needs a 'schema'", param="response_format")
    return {"response_format": ("json", fmt.json_schema.json_schema)}


def _from_structured_outputs(options: StructuredOutputs) -> Given:
    specs = {kind: getattr(options, "json_" if kind == "json" else kind) for kind in KINDS}
    return {f"structured_outputs.{kind}": (kind, spec) for kind, spec in specs.items() if spec not in (None, False)}


def _build(
    given: Given,
    options: StructuredOutputs | None,
    backend: str | None = None,
    whitespace_pattern: str | None = None,
) -> GuidedDecodingParams | None:
    if len(given) > 1:
        names = list(given)
        raise APIError(f"guided decoding: give one constraint, got {', '.join(names)}", param=names[0].split(".")[0])
    if not given:
        if options is not None:
            raise APIError(f"structured_outputs: give one of {', '.join(KINDS)}", param="structured_outputs")
        return None
    ((kind, spec),) = given.values()
    if kind == "structural_tag":
        spec = structural_tag_json(spec)
    flags: dict[str, Any] = {}
    if options is not None:
        flags = {"disable_fallback": options.disable_fallback, "disable_any_whitespace": options.disable_any_whitespace}
        whitespace_pattern = options.whitespace_pattern or whitespace_pattern
    params = GuidedDecodingParams(**{kind: spec}, backend=backend, whitespace_pattern=whitespace_pattern, **flags)
    if options is not None and options.disable_additional_properties and params.kind == "json":
        params = dataclasses.replace(params, json=closed_objects(params.json))
    return params


def structural_tag_json(spec: str | dict) -> str:
    """xgrammar's structural tag as JSON text. vLLM's older form, ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}``, becomes the same constraint in the ``triggered_tags`` format that
    current xgrammar reads: free text until a trigger, then one of the tags."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested past Python's stack
            raise ValueError(f"structural_tag: not valid JSON: {exc}") from None
    if isinstance(spec, dict) and "structures" in spec:
        try:
            tags = [
                {"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
                for s in spec["structures"]
            ]
        except (KeyError, TypeError):
            raise ValueError("structural_tag: each of 'structures' needs 'begin', 'schema' and 'end'") from None
        format_ = {"type": "triggered_tags", "triggers": spec.get("triggers") or [], "tags": tags}
        spec = {"type": "structural_tag", "format": format_}
    return json.dumps(spec)


def closed_objects(schema: Any) -> Any:
    """A copy of the JSON schema in which every object schema that does not say otherwise has
    ``additionalProperties: false`` (vLLM's ``disable_additional_properties``)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = [closed_objects(sub) for sub in value] if isinstance(value, list) else closed_objects(value)
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
