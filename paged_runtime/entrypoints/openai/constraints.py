"""The output constraint a request asks for, from whichever field it uses, as one ``StructuredOutputsParams``.

Spellings: vLLM's ``structured_outputs`` object; the older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``; OpenAI's ``response_format`` (chat); and, for chat, a ``tool_choice``
of ``"required"`` or a named function (``tool_calls.py`` builds that schema). At most one may be used; the
field it came from is what an error names (``ParameterError.param`` "structured_outputs" is mapped to it).
"""
from __future__ import annotations

from typing import Any

from paged_runtime.entrypoints.openai.errors import bad_request
from paged_runtime.sampling_params import ParameterError, StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# vLLM's structured_outputs keys this runtime reads; others (structural_tag, whitespace_pattern, ...) are refused.
# disable_fallback changes nothing here: xgrammar is the only backend, there is no fallback either way.
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                   "disable_fallback", "disable_additional_properties")
BACKENDS = (None, "auto", "xgrammar")


def request_constraint(req, extra: list[tuple[str, StructuredOutputsParams]] = ()
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from), or (None, None). ``extra``: route-specific
    sources (chat's response_format / tool_choice). A 400 for two sources at once or a malformed one."""
    if req.guided_decoding_backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend {req.guided_decoding_backend!r} is not available: this server "
                          "compiles constraints with xgrammar ('xgrammar' or 'auto')", param="guided_decoding_backend")
    found = list(extra)
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, _params(name, **{kind: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one output constraint may be given; this request sets {names}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _from_structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(body) - set(STRUCTURED_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported; supported keys: "
                          f"{', '.join(STRUCTURED_KEYS)}", param=f"structured_outputs.{unknown[0]}",
                          code="unsupported_parameter")
    if body.get("disable_additional_properties"):
        raise bad_request("structured_outputs.disable_additional_properties is not supported; set "
                          "\"additionalProperties\": false in the schema", param="structured_outputs",
                          code="unsupported_parameter")
    kinds = {k: body[k] for k in ("json", "regex", "choice", "grammar") if body.get(k) is not None}
    return _params("structured_outputs", **kinds, json_object=bool(body.get("json_object")),
                   any_whitespace=body.get("disable_any_whitespace") is False)


def response_format_constraint(response_format) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (none), json_object, json_schema (its ``schema``, always strict)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema")
    return StructuredOutputsParams(json=spec.json_schema)


def _params(param: str, **kinds) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kinds)
    except ParameterError as e:
        raise bad_request(str(e).replace("structured_outputs", param, 1), param=param, code=e.code) from e
    except TypeError as e:
        raise bad_request(f"{param}: {e}", param=param) from e
