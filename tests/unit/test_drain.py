"""The graceful-shutdown pieces (entrypoints/openai/drain.py) without a server: the gate and its counter,
the middleware's 503, the drain-then-stop order, and the signal handler that runs it."""
from __future__ import annotations

import asyncio
import signal

import httpx

from paged_runtime.entrypoints.openai.drain import Drain, DrainMiddleware, GracefulShutdown, drain_then_stop

SHUTTING_DOWN = {"error": {"message": "The server is shutting down; retry the request on another replica.",
                           "type": "server_error", "param": None, "code": "server_shutting_down"}}


def test_drain_admits_until_started_and_counts_in_flight():
    async def main():
        drain = Drain()
        assert drain.enter() and drain.enter() and drain.in_flight == 2
        drain.start()
        assert not drain.enter() and drain.in_flight == 2  # refused requests are not counted
        drain.leave()
        assert not await drain.wait_idle(0.01)
        drain.leave()
        assert await drain.wait_idle(0.01) and drain.in_flight == 0
    asyncio.run(main())


class GatedApp:
    """An ASGI app whose response waits for ``release``; ``started`` is set once a request is inside."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        self.started.set()
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})


def test_middleware_counts_a_request_until_its_response_is_sent_and_refuses_while_draining():
    async def main():
        drain, app = Drain(), GatedApp()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=DrainMiddleware(app, drain)),
                                   base_url="http://test")
        in_flight = asyncio.create_task(client.get("/v1/completions"))
        await asyncio.wait_for(app.started.wait(), 10)
        assert drain.in_flight == 1
        drain.start()
        refused = await client.get("/health")
        assert refused.status_code == 503 and refused.json() == SHUTTING_DOWN
        assert refused.headers["retry-after"] == "1"
        app.release.set()
        response = await asyncio.wait_for(in_flight, 10)
        assert (response.status_code, response.text, drain.in_flight) == (200, "done", 0)
        await client.aclose()
    asyncio.run(main())


def test_drain_then_stop_waits_for_in_flight_requests_and_leaves_the_engine_alone():
    stopped = []

    async def main():
        drain = Drain()
        assert drain.enter()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, drain.leave)  # the request finishes during the drain
        await asyncio.wait_for(drain_then_stop(drain, 60.0, lambda: stopped.append(True)), 10)
        assert drain.draining and drain.in_flight == 0
    asyncio.run(main())
    assert stopped == []


def test_drain_then_stop_stops_the_engine_after_the_timeout_and_waits_for_the_error_responses():
    async def main():
        drain = Drain()
        assert drain.enter()
        loop = asyncio.get_running_loop()

        def stop_engine():  # fails the request: its error response goes out, then it leaves
            loop.call_soon_threadsafe(drain.leave)

        await asyncio.wait_for(drain_then_stop(drain, 0.01, stop_engine), 10)
        assert drain.in_flight == 0
    asyncio.run(main())


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0)


def test_signal_handler_drains_then_stops_the_server_and_a_second_signal_hurries():
    async def main():
        drain, stopped, exits = Drain(), asyncio.Event(), []
        assert drain.enter()
        loop = asyncio.get_running_loop()

        def stop_engine():
            loop.call_soon_threadsafe(stopped.set)
            loop.call_soon_threadsafe(drain.leave)

        class FakeServer:
            handle_exit = None

        server = FakeServer()
        GracefulShutdown(drain, 3600.0, stop_engine, on_drained=exits.append).install(server)
        server.handle_exit(signal.SIGTERM, None)  # hands over to the loop
        await asyncio.wait_for(until(lambda: drain.draining), 10)
        assert drain.draining and exits == [] and not stopped.is_set()  # waiting for the request
        server.handle_exit(signal.SIGTERM, None)  # a second signal: stop waiting
        await asyncio.wait_for(stopped.wait(), 10)
        await asyncio.wait_for(until(lambda: exits), 10)
        assert exits == [signal.SIGTERM]
    asyncio.run(main())


def test_signal_before_the_loop_runs_stops_at_once():
    exits = []
    GracefulShutdown(Drain(), 30.0, lambda: None, on_drained=exits.append).handle_exit(signal.SIGINT, None)
    assert exits == [signal.SIGINT]
