"""OpenAI's error body, and the mapping from everything that can go wrong to a status code.

Every error the routes return has the shape ``{"error": {"message", "type",
"param", "code"}}``. A client's mistake is a 4xx whose ``param`` names the
field; the engine being full or down is a 503; nothing a client sends can
produce a 500. A message may quote the client's text: it is made encodable
(lone surrogates escaped) when the error is built, so answering never fails.

``parse_json`` is the only way a body becomes data: it refuses what would
break a later layer (a lone UTF-16 surrogate anywhere, nesting deeper than
``MAX_JSON_DEPTH``) with a 400, so nothing past it meets such a string.
"""
from __future__ import annotations

import json
import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from paged_runtime.engine.client import EngineDeadError, EngineOverloadedError, RequestFailedError
from paged_runtime.sampling_params import ParameterError

CLIENT_CLOSED_REQUEST = 499  # nginx's code; the client never sees it

logger = logging.getLogger(__name__)

# OpenAI bodies nest 4 deep (messages[i].content[j].text); chat_template_kwargs may add a few levels.
MAX_JSON_DEPTH = 64


class OpenAIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = encodable(message), None if param is None else encodable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def payload_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                       code="request_too_large")


def unsupported_media_type(content_type: str) -> OpenAIError:
    return OpenAIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}.",
                       code="unsupported_media_type")


def encodable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\ud800``), so it can be UTF-8 encoded."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def from_exception(e: BaseException) -> OpenAIError:
    """Any exception as an OpenAIError; unexpected ones become a 500 and are logged with their traceback."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValidationError):
        return from_validation_error(e)
    if isinstance(e, RequestValidationError):  # a query or path parameter of the wrong type
        return _invalid(e.errors()[0], skip=1)  # its loc starts with where it came from: ("query", "limit")
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(503, str(e), type="server_overloaded", code="server_overloaded",
                           headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, ClientDisconnect):  # the client left while its body was read: nobody to answer, nothing wrong
        return OpenAIError(CLIENT_CLOSED_REQUEST, "the client closed the connection", code="client_closed_request")
    if isinstance(e, RequestFailedError):  # the engine failed this request alone (and logged why)
        return OpenAIError(500, str(e), type="server_error", code="request_failed")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, ParameterError):
        return from_parameter_error(e)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    logger.error("unexpected error while serving a request", exc_info=e)
    return OpenAIError(500, f"internal server error: {type(e).__name__}", type="server_error")


def from_parameter_error(e: ParameterError, param: str | None = None) -> OpenAIError:
    """A 400 naming ``e``'s field, or ``param`` where the route spells that field differently."""
    return bad_request(str(e), param=param or e.param, code=e.code)


def from_validation_error(e: ValidationError) -> OpenAIError:
    """The first problem pydantic found, with its field path as ``param``."""
    return _invalid(e.errors(include_url=False)[0])


def _invalid(error: dict, skip: int = 0) -> OpenAIError:
    """A 400 for one of pydantic's error entries, naming the field at its ``loc`` (less ``skip`` leading parts)."""
    loc = _field_path(tuple(error["loc"])[skip:])
    if error["type"] == "missing":
        return bad_request(f"Missing required parameter: '{loc}'.", param=loc, code="missing_required_parameter")
    if not loc:
        return bad_request(f"Invalid request body: {error['msg']}")
    return bad_request(f"Invalid value for '{loc}': {error['msg']}", param=loc, code="invalid_value")


def _field_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; pydantic's union-member tags are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_union_tag(part):
            continue
        else:
            path += f".{part}" if path else part
    return path


def _is_union_tag(part: str) -> bool:
    # pydantic names the member of a union it tried: 'str', 'list[int]', 'function-after[...]', ...
    return part in {"str", "int", "float", "bool", "dict", "list", "none"} or "[" in part or part.startswith(
        ("function-", "tagged-union", "nullable"))


def parse_json(body: bytes) -> object:
    """The body as data; a 400 for invalid JSON, nesting deeper than MAX_JSON_DEPTH or a lone surrogate."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError as e:  # the C decoder's own depth guard: no Python stack was harmed
        raise _too_deep() from e
    check_json_tree(data)
    return data


def check_json_tree(data: object) -> None:
    """Raises a 400 if ``data`` nests deeper than MAX_JSON_DEPTH or holds a string (key or value) that
    is not valid Unicode (JSON's ``\\ud800`` escape decodes to a lone surrogate). Iterative: no recursion."""
    if isinstance(data, str):
        _check_string(data, ())
    stack: list[tuple[object, tuple]] = [(data, ())] if isinstance(data, (dict, list)) else []  # containers
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise _too_deep()
        items = node.items() if isinstance(node, dict) else enumerate(node)  # type: ignore[union-attr]
        for key, value in items:
            if type(key) is str:
                _check_string(key, path)
            if type(value) is str:
                _check_string(value, path + (key,))
            elif isinstance(value, (dict, list)):
                stack.append((value, path + (key,)))


def _check_string(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or None
        raise bad_request(f"Invalid string{f' in {param!r}' if param else ''}: it holds a lone UTF-16 surrogate "
                          f"at position {e.start}; strings must be valid Unicode.", param=param,
                          code="invalid_unicode") from None


def _too_deep() -> OpenAIError:
    return bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")

