"""An HTTP request carried across a DeploymentHandle as data, and its response streamed back in parts.

In multi-replica mode the ingress does not speak OpenAI itself: it forwards
each request (``ForwardedRequest``) to a model replica, which runs the very
same OpenAI app the single-replica mode serves (``stream_asgi``), so both
modes share one implementation of every route, error body and SSE stream.

Contract of ``stream_asgi``: it yields one ``ResponseStart``, then the body
in the chunks the app sends (an SSE stream: one chunk per event). Closing it
early, because the caller went away or was cancelled, delivers
``http.disconnect`` to the app, and the OpenAI routes abort their engine
requests exactly as when a directly connected client disconnects.

No torch here: the ingress imports this module.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
Headers = tuple[tuple[bytes, bytes], ...]

# Headers that describe one hop's framing; each side of the handle frames its own.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"trailer",
                        b"upgrade", b"proxy-connection"})
APP_EXIT_TIMEOUT_S = 10.0  # after a disconnect, the app gets this long to abort and return


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """What the model replica needs to run the request, plus what the router routes it by: its prompt (prefix
    affinity) and its adapter (multiplexing)."""
    method: str
    path: str  # relative to the application's route prefix
    query_string: bytes = b""
    headers: Headers = ()
    body: bytes = b""
    routing_key: str | None = None
    routing_tokens: tuple[int, ...] | None = None  # the prompt's token ids, for KV-event routing
    lora_name: str | None = None  # the LoRA adapter ``model`` names (``lora.AdapterNames``): routed to its holders


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: Headers

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == wanted), None)

    def end_to_end_headers(self) -> dict[str, str]:
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self.headers if k.lower() not in HOP_BY_HOP}


def scope_of(request: ForwardedRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
            "root_path": "", "query_string": request.query_string, "headers": list(request.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


async def stream_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request``: yields the ResponseStart, then body chunks (see the module docstring)."""
    messages: asyncio.Queue[dict] = asyncio.Queue()
    gone = asyncio.Event()
    body_taken = False

    async def receive() -> dict:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # the app listens for a disconnect while it streams: it comes when we are closed
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    task = asyncio.ensure_future(app(scope_of(request), receive, send))
    try:
        while True:
            message = await _next_message(messages, task)
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message["headers"]))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        await _settle(task)


async def _next_message(messages: asyncio.Queue[dict], task: asyncio.Future) -> dict:
    if messages.empty() and not task.done():
        getter = asyncio.ensure_future(messages.get())
        try:
            await asyncio.wait([getter, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
    if not messages.empty():
        return messages.get_nowait()
    task.result()  # the app raised: let its error through
    raise RuntimeError("the ASGI app returned without completing its response")


async def _settle(task: asyncio.Future) -> None:
    """Let the app finish (it is aborting after the disconnect); cancel it if it does not in time."""
    if not task.done():
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), APP_EXIT_TIMEOUT_S)
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()  # mark it retrieved: surfaced by _next_message already, or moot after a full response
