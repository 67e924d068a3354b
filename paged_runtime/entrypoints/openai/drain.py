"""Graceful shutdown: a gate that refuses new requests while draining, and counts the ones in flight.

``Drain`` is shared by the HTTP app (``DrainMiddleware`` around it) and by whatever stops the server
(``GracefulShutdown`` on a uvicorn server's signal, or a Ray Serve replica's ``__del__``). The order is:

1. ``drain.start()``: every new HTTP request, ``/health`` included, is answered 503 with an OpenAI
   error body (code ``server_shutting_down``), so load balancers take the replica out of rotation;
2. requests already in flight run on, up to the shutdown timeout (``wait_idle``);
3. then the engine is shut down: it fails whatever still runs with ``EngineDeadError``, so a stream
   ends with an error event and ``data: [DONE]`` and a non-streaming request gets a 503 error body
   (the routes' own error handling), never a cut connection;
4. once those responses are written, the server stops.

A request counts as in flight from the moment the middleware admits it until its response has been
sent in full (a stream's last byte included). Everything here runs on the server's event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from paged_runtime.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # a Kubernetes pod's default terminationGracePeriodSeconds
RESPONSE_GRACE_S = 5.0  # after the engine failed the rest, how long their error responses get to go out


class Drain:
    """Admission gate plus in-flight counter (one event loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()  # set whenever nothing is in flight (binds to a loop on first wait)
        self._idle.set()

    def start(self) -> None:
        """Refuse every request from now on; those in flight go on. Idempotent."""
        self.draining = True

    def enter(self) -> bool:
        """Admit one request (False while draining); each True must be matched by one ``leave()``."""
        if self.draining:
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight, False if ``timeout`` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "The server is shutting down; retry the request on another replica.",
                       type="server_error", code="server_shutting_down",
                       headers={"Retry-After": "1", "Connection": "close"})


class DrainMiddleware:
    """ASGI middleware: counts HTTP requests in flight and answers 503 ``server_shutting_down`` while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.drain.enter():
            await shutting_down().response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


async def drain_then_stop(drain: Drain, timeout: float, stop_engine: Callable[[], None],
                          hurry: asyncio.Event | None = None) -> None:
    """Steps 1-3 of the module docstring; returns once every admitted request has its response.

    ``stop_engine`` (blocking, run in a thread) is called only if requests are left after ``timeout``
    seconds, or at once when ``hurry`` is set (a second signal). The caller stops the server after.
    """
    drain.start()
    logger.info("shutting down: refusing new requests; %d in flight get up to %g s to finish",
                drain.in_flight, timeout)
    if not await _idle_or_hurry(drain, timeout, hurry):
        logger.warning("shutting down: %d request(s) still running; ending them with an error", drain.in_flight)
        await asyncio.to_thread(stop_engine)
        if not await drain.wait_idle(RESPONSE_GRACE_S):
            logger.error("shutting down: %d response(s) did not end in %g s", drain.in_flight, RESPONSE_GRACE_S)


async def _idle_or_hurry(drain: Drain, timeout: float, hurry: asyncio.Event | None) -> bool:
    if hurry is None:
        return await drain.wait_idle(timeout)
    idle = asyncio.ensure_future(drain.wait_idle(timeout))
    hurried = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait([idle, hurried], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hurried.cancel()
        if not idle.done():
            idle.cancel()
    return idle.done() and not idle.cancelled() and idle.result()


class GracefulShutdown:
    """Replaces a uvicorn server's signal handling with the drain (see the module docstring).

    uvicorn's own ``handle_exit`` stops accepting at once and cancels whatever runs after
    ``timeout_graceful_shutdown``, cutting streams. Installed instead, the first SIGINT/SIGTERM starts
    ``drain_then_stop``; a second one stops waiting for requests to finish. ``on_drained(sig)`` is
    called at the end; it must make the server exit (``server.should_exit = True`` at the least). The
    signal is not re-raised after serving, so the process exits normally (status 0).
    """

    def __init__(self, drain: Drain, timeout: float, stop_engine: Callable[[], None],
                 on_drained: Callable[[int], None]) -> None:
        self.drain, self.timeout, self.stop_engine, self.on_drained = drain, timeout, stop_engine, on_drained
        self._task: asyncio.Task | None = None
        self._hurry = asyncio.Event()

    def install(self, server) -> None:
        """``server``: a ``uvicorn.Server`` not yet serving (it installs ``handle_exit`` when it starts)."""
        server.handle_exit = self.handle_exit

    def handle_exit(self, sig: int, frame=None) -> None:
        """The signal handler (main thread, the server's loop running): hand over to the loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet: nothing to drain
            self.on_drained(sig)
            return
        loop.call_soon_threadsafe(self._on_signal, sig)  # signal-safe: wakes the loop through its self-pipe

    def _on_signal(self, sig: int) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run(sig))
        else:
            logger.info("shutting down: second signal, ending the requests still running now")
            self._hurry.set()

    async def _run(self, sig: int) -> None:
        try:
            await drain_then_stop(self.drain, self.timeout, self.stop_engine, self._hurry)
        except Exception:
            logger.exception("graceful shutdown failed; stopping now")
        self.on_drained(sig)
