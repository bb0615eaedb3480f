"""What a request hands the runtime, as plain values: the target's sampling (SamplingConfig) and the form its output
must take (ResponseFormat, parsed from OpenAI's `response_format`). Neither torch nor numpy is imported here: the
command line's flags and a request's checks are made from these before the runtime is."""

import json
from dataclasses import dataclass

from dtrt.errors import DtrtError


@dataclass(frozen=True)
class SamplingConfig:
    """The target's sampling (checked where a request is made: dtrt.frontend.requests.make_request)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class ResponseFormat:
    """What a request asks the output to be: `json_schema` (the schema, OpenAI's name and strict) or `json_object`."""

    kind: str  # "json_schema" | "json_object"
    schema: dict | None = None
    name: str | None = None
    strict: bool | None = None

    @property
    def text(self) -> str:
        return json.dumps(self.schema if self.kind == "json_schema" else {"type": "object"})


def parse_response_format(value, field: str = "response_format") -> ResponseFormat | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}; anything else one DtrtError naming `field`."""
    if value is None:
        return None
    kinds = "'text', 'json_object' or 'json_schema'"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise DtrtError(f"{field}: must be an object with a 'type' ({kinds})")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if kind not in ("text", "json_object", "json_schema"):
        raise DtrtError(f"{field}.type {kind!r}: use {kinds}")
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise DtrtError(f"{field}: unknown key {(extra or ['json_schema'])[0]!r} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise DtrtError(f"{field}.json_schema: required with type 'json_schema', an object with 'name' and 'schema'")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise DtrtError(f"{field}.json_schema: unknown key {unknown[0]!r}; it takes name, schema, strict, description")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise DtrtError(f"{field}.json_schema.name: required, a non-empty string")
    if not isinstance(schema, dict):
        raise DtrtError(f"{field}.json_schema.schema: required, a JSON schema object")
    if strict is not None and not isinstance(strict, bool):
        raise DtrtError(f"{field}.json_schema.strict {strict!r}: must be true or false")
    return ResponseFormat("json_schema", schema, name, strict)
