"""How engine errors reach HTTP clients: each kind its own status and OpenAI error code."""
import json

from paged_runtime.engine.client import EngineDeadError, EngineOverloadedError, RequestFailedError
from paged_runtime.entrypoints.openai.errors import from_exception


def test_a_request_the_engine_failed_alone_is_a_500_with_an_openai_body():
    error = from_exception(RequestFailedError("the engine failed this request: IndexError"))
    body = json.loads(error.response().body)
    assert error.status == 500
    assert body == {"error": {"message": "the engine failed this request: IndexError", "type": "server_error",
                              "param": None, "code": "request_failed"}}


def test_engine_wide_errors_keep_their_codes():
    dead = from_exception(EngineDeadError("gone"))
    assert (dead.status, dead.code) == (503, "engine_unavailable")
    assert from_exception(EngineOverloadedError("full")).status == 503


def test_a_client_that_left_while_its_body_was_read_is_not_an_error(caplog):
    """The soak's disconnects during a body logged a traceback per request as an 'unexpected error'."""
    from starlette.requests import ClientDisconnect
    with caplog.at_level("ERROR"):
        error = from_exception(ClientDisconnect())
    assert (error.status, error.code) == (499, "client_closed_request")
    assert not caplog.records
