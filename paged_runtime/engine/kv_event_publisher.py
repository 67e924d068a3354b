"""Publishing KV-cache event batches (``core/kv_events.py``) as vLLM's ``ZmqEventPublisher`` does, without ever
blocking the step loop.

``publish(events)`` is called by the engine core once per step with a non-empty batch, on the step-loop thread.
It stamps the batch with the time and the next sequence number and puts it on a bounded queue
(``max_queue_size``); a full queue drops the batch and counts it in ``vllm:kv_events_dropped_batches`` (a
Prometheus counter labelled by model name; vLLM has none, its publisher waits for room). One daemon sender
thread owns the sockets: it encodes each batch and sends it (a batch it cannot encode or send is logged and
counted as dropped too), and answers replay requests.

The wire, as vLLM's:

- PUB socket on ``endpoint`` (bound if it holds ``*`` or ``::`` or is ``ipc://`` / ``inproc://``, connected
  otherwise, vLLM's rule), high-water mark ``hwm``; each batch is one multipart message
  ``(topic, seq as 8 bytes big-endian, payload)``;
- ROUTER socket bound on ``replay_endpoint`` (optional): a client (a DEALER sending an empty delimiter frame
  first; a REQ socket reads only the first reply) sends a start sequence number as 8 bytes big-endian and
  gets, from that number on, the batches still buffered (the last ``buffer_steps``; a batch published before
  the request arrived is sent first, so it is among them), one message each, then the end marker: sequence
  -1 (``ff`` * 8) with an empty payload. In the ``array`` format (vLLM up to 0.25) a reply is
  ``(seq, payload)`` and the marker ``(-1, b"")``; in the ``map`` format (vLLM 0.26 on,
  vllm-project/vllm#45177) a reply carries the topic first, ``(topic, seq, payload)``, and the marker
  ``(b"", -1, b"")``.

Sequence numbers start at 0 and rise by one per published batch. A dropped batch keeps its number, so it
leaves a gap that replay cannot fill: a subscriber can tell it lost events (vLLM's publisher never drops; it
waits for room instead, which would stall the step).

``close()`` sends what is queued, stops the thread and closes the sockets; later batches are ignored.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from paged_runtime.core.block_hash import external_hash_form
from paged_runtime.core.kv_events import KVEvent, KVEventsConfig, encode_batch
from paged_runtime.metrics import families

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how often an idle sender thread looks for replay requests and for close()


class EventPublisher(Protocol):
    bound_endpoint: str | None  # the address the PUB socket bound, if it bound one

    def publish(self, events: list[KVEvent]) -> None:
        """Hand one step's events over; returns at once (never waits for the network)."""

    def close(self) -> None:
        """Send what is queued, then stop; idempotent. Later batches are ignored."""


class NullEventPublisher:
    """Events off: nothing is recorded, so nothing is ever published."""
    bound_endpoint = None

    def publish(self, events: list[KVEvent]) -> None:
        pass

    def close(self) -> None:
        pass


def make_publisher(config: KVEventsConfig | None, event_format: str, model_name: str,
                   registry: CollectorRegistry | None = None) -> EventPublisher:
    """The publisher ``config`` asks for; the ZMQ one counts drops in ``registry`` (default: the process's)."""
    if config is None or not config.active:
        return NullEventPublisher()
    return ZmqEventPublisher(config, event_format, families(registry).kv_events_dropped.labels(model_name).inc)


class ZmqEventPublisher:
    """PUB + optional ROUTER replay sockets behind a bounded queue and one sender thread (module docstring).

    The sockets are created, used and closed on the sender thread only (ZMQ sockets are not thread-safe); the
    constructor waits until they are bound or connected and raises what failed (a port in use, a bad address).
    """

    def __init__(self, config: KVEventsConfig, event_format: str = "array",
                 on_drop: Callable[[], None] = lambda: None) -> None:
        import zmq  # only a configured ZMQ publisher needs it
        self._zmq = zmq
        self.config = config
        self.event_format = event_format
        self._on_drop = on_drop
        self._external = external_hash_form()
        self.bound_endpoint: str | None = None  # set once bound: the actual address (a '*' port filled in)
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._closed = False  # publish() ignores batches from now on
        self._stopping = False  # the sender thread stops once the queue is empty
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="paged-runtime-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    # ---- the step loop's side ---------------------------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((next(self._seq), time.time(), events))
        except queue.Full:
            self._on_drop()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then stop; idempotent."""
        if self._closed:
            return
        self._closed = self._stopping = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV-event publisher: %d batches still queued after %.0f s; left unsent",
                           self._queue.qsize(), timeout)

    # ---- the sender thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            pub, replay = self._open_sockets()
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        except Exception:  # the replay socket; a batch's own failure is _send's
            logger.exception("KV-event publisher thread failed; no more events are sent")
        finally:
            for socket in (pub, replay):
                if socket is not None:
                    socket.close(linger=0)

    def _open_sockets(self) -> tuple[Any, Any]:
        zmq, config = self._zmq, self.config
        context = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        replay = None
        try:
            pub.set_hwm(config.hwm)
            if binds(config.endpoint):
                pub.bind(config.endpoint)
                self.bound_endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(config.replay_endpoint)
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _serve(self, pub, replay) -> None:
        """Send batches as they come and answer replay requests, until ``close()`` and an empty queue."""
        while not (self._stopping and self._queue.empty()):
            if replay is not None and replay.poll(0):
                self._send_queued(pub)  # published before the request came: they belong in the answer
                self._answer_replay(replay)
                continue
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._send(pub, *item)

    def _send_queued(self, pub) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._send(pub, *item)

    def _send(self, pub, seq: int, ts: float, events: list[KVEvent]) -> None:
        """Send one batch and keep it for replay; one that cannot be encoded or sent is logged and counted as
        dropped (its sequence number stays a gap), and the thread goes on."""
        try:
            payload = encode_batch(ts, events, self.event_format, self._external)
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:
            logger.exception("KV-event publisher: batch %d not sent", seq)
            self._on_drop()
            return
        self._buffer.append((seq, payload))

    def _answer_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-event replay: ignored a request of %d frames (want identity, empty, start)",
                           len(frames))
            return
        client, delimiter, start = frames
        start_seq = int.from_bytes(start, "big")
        topic = (self._topic,) if self.event_format == "map" else ()
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart((client, delimiter, *topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, delimiter, *((b"",) if topic else ()), END_SEQ, b""))


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc:// or inproc:// endpoint; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
