"""The OpenAI spec the routes answer to (tests/data/openai-subset.json: see tests/data/README.md), as JSON Schema
components: the server tests and the soak harness validate bodies against it."""
from __future__ import annotations

import json
from pathlib import Path

SPEC_PATH = Path(__file__).resolve().parents[1] / "data" / "openai-subset.json"


def _nullable_to_json_schema(node):
    """OpenAPI 3.0's ``nullable: true`` (still used inside this 3.1 document) as JSON Schema's null type."""
    if isinstance(node, list):
        return [_nullable_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable_to_json_schema(v) for k, v in node.items()}
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def openai_components() -> dict:
    """The spec's components with ``CompletionStreamChunk`` added: the spec gives streamed and whole
    completions one shape, but OpenAI (and vLLM) stream finish_reason null until a choice's last chunk (the
    chat chunk schema already says so)."""
    components = _nullable_to_json_schema(json.loads(SPEC_PATH.read_text())["components"])
    chunk = json.loads(json.dumps(components["schemas"]["CreateCompletionResponse"]))
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    components["schemas"]["CompletionStreamChunk"] = chunk
    return components
