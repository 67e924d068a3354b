"""The runtime as a ``kserve.Model``: the engine starts on the server's loop, readiness follows it.

Lifecycle
    ``load()`` only marks the model registrable (KServe registers ready
    models only); the weights load in ``start_engine()``, which ModelServer
    runs on its event loop beside the HTTP server (``engine = True``). The
    blocking build runs in a worker thread, so the server answers while it
    loads: ``healthy()``, and with it ``/v1/models/NAME`` and
    ``/v2/models/NAME/ready``, is False (503) until the engine serves, and
    again once it has died. ``stop_engine()`` shuts the engine down: the
    drain calls it when ``--shutdown-timeout`` runs out (whatever still runs
    fails with EngineDeadError), KServe when it unloads the model after the
    HTTP server stopped; a stop that comes while the engine is still
    building shuts it down as soon as it is built. Once the engine is up,
    ``on_engine_up`` (``server.py``: the OpenAI routes' ``start``, which
    checks the ``--lora-modules`` adapters) runs before the model says it is
    healthy; if it raises, the engine is shut down and the start fails.

Inference
    ``predict`` gets a dict for v1 and an ``InferRequest`` for v2
    (``protocol.py`` maps both); a client's mistake is ``InvalidInput``
    (400), a full queue ``EngineOverloadedError`` and a dead engine
    ``EngineDeadError`` (both 503, see ``server.py``). A request's prompts
    are checked and tokenized on the serving object's tokenizer worker (its
    own tokenizer copy, its one thread), never on the event loop: a long
    prompt does not stall the server (health routes included) while it is
    tokenized. ``limits`` (the ``--max-prompts-per-request`` and
    ``--max-request-body-bytes`` flags) bound each request. KServe's v1/v2
    endpoints do not watch for a client's disconnect, so such a request runs
    to its end (bounded by ``max_tokens``); the OpenAI routes abort theirs.
    ``run`` serves a LoRA adapter over this model too (``lora.AdapterModel``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Sequence

from kserve import Model
from kserve.errors import InvalidInput, ModelNotReady
from kserve.protocol.infer_type import InferRequest, InferResponse

from kserve_adapter import protocol
from paged_runtime.engine.client import EngineClient, RequestStream
from paged_runtime.entrypoints.openai.access import ApiKeys
from paged_runtime.entrypoints.openai.serving import OpenAIServing, RequestLimits, collect
from paged_runtime.lora.request import LoRARequest
from paged_runtime.outputs import RequestOutput

logger = logging.getLogger("kserve_adapter")

# Test-only hook: when set, start_engine() waits until this file exists before building the engine, so a
# test can observe the loading window (503 -> 200) deterministically. Never set it in a deployment.
LOAD_GATE_ENV = "KSERVE_ADAPTER_LOAD_GATE"
# Several models in one process build their engines one at a time: concurrent builds race in transformers'
# lazy imports ("cannot import name 'AutoTokenizer'") and would only share the same cores.
_BUILD_LOCK = threading.Lock()


class PagedRuntimeModel(Model):
    def __init__(self, name: str, served_model_names: Sequence[str], engine_factory: Callable[[], EngineClient],
                 limits: RequestLimits | None = None, api_keys: ApiKeys | None = None):
        """``engine_factory`` builds the engine (blocking; it runs in a worker thread); ``limits`` bound each
        request (default: the runtime's defaults); ``api_keys``: the tenant each request's key is (the server's
        middleware has refused requests without a valid one)."""
        super().__init__(name)
        self.engine = True  # tells ModelServer to run start_engine() on its loop
        self.served_model_names = list(served_model_names)
        self.engine_factory = engine_factory
        self.limits = limits or RequestLimits()
        self.api_keys = api_keys or ApiKeys()
        self.async_engine: EngineClient | None = None
        self.serving: OpenAIServing | None = None  # the OpenAI routes' request checks, over this engine
        self.on_engine_up: Callable[[], Awaitable[None]] | None = None  # see the module docstring
        self._up = False  # the engine is built and on_engine_up passed: healthy() may say True
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def load(self) -> bool:
        """Nothing to load yet (start_engine does); KServe's dataplane also calls this while not healthy."""
        self.ready = True
        return self.ready

    async def start_engine(self) -> None:
        await self._wait_for_load_gate()
        if self._stopping:
            return
        logger.info("building the engine for %s", self.name)
        engine = await asyncio.to_thread(self._build_engine)
        if self._stopping:  # stopped while building: nobody will serve with it
            engine.shutdown()
            return
        self.serving = OpenAIServing(engine, self.served_model_names, self.limits)
        self.async_engine = engine
        if self.on_engine_up is not None:
            try:
                await self.on_engine_up()
            except BaseException:
                self.stop_engine()
                raise
        self._up = True
        logger.info("model %s is ready (max_model_len %d)", self.name, engine.max_model_len)

    def _build_engine(self) -> EngineClient:
        with _BUILD_LOCK:
            return self.engine_factory()

    async def healthy(self) -> bool:
        return self._up and self.async_engine is not None and self.async_engine.is_healthy

    def stop(self) -> None:
        self.ready = False

    def stop_engine(self) -> None:
        """Shut the engine down (idempotent); in-flight requests fail with EngineDeadError."""
        self._stopping = True
        self.ready = False
        engine, self.async_engine = self.async_engine, None
        if engine is not None:
            engine.shutdown()
            logger.info("engine of %s shut down", self.name)

    async def _wait_for_load_gate(self) -> None:
        gate = os.environ.get(LOAD_GATE_ENV)
        if not gate:
            return
        logger.warning("%s is set (a test hook): the engine waits for %s to exist", LOAD_GATE_ENV, gate)
        while not (self._stopping or os.path.exists(gate)):
            await asyncio.sleep(0.02)

    # ---- inference ---------------------------------------------------------------------------
    def get_input_types(self) -> list[dict]:
        return protocol.INPUT_TYPES

    def get_output_types(self) -> list[dict]:
        return protocol.OUTPUT_TYPES

    async def predict(self, payload: dict | InferRequest, headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None) -> dict | InferResponse:
        return await self.run(payload, headers, self.name)

    async def run(self, payload: dict | InferRequest, headers: dict[str, str] | None, name: str,
                  adapter: Callable[[EngineClient], Awaitable[LoRARequest]] | None = None) -> dict | InferResponse:
        """``payload`` answered as the KServe model ``name``: this model, or with ``adapter`` a LoRA adapter
        over it. ``adapter(engine)`` gives the adapter once the prompts are ready, and nothing is awaited
        between it and the submission: an adapter unloaded meanwhile is refused there, never submitted."""
        engine, serving = self.async_engine, self.serving
        if engine is None or serving is None:
            raise ModelNotReady(name)
        request_id = f"kserve-{uuid.uuid4().hex}"
        tenant = self.api_keys.authenticate((headers or {}).get("authorization"))
        batch = [dataclasses.replace(p, cache_salt=tenant.cache_salt(p.cache_salt))
                 for p in await self._prepare(serving, payload)]
        lora_request = await adapter(engine) if adapter is not None else None
        outputs = await self._generate(engine, request_id, batch, lora_request)
        if isinstance(payload, InferRequest):
            return protocol.v2_response(payload, name, outputs, request_id)
        return protocol.v1_response(outputs)

    async def explain(self, payload: dict, headers: dict[str, str] | None = None) -> dict:
        raise no_explainer(self.name)

    @staticmethod
    async def _prepare(serving: OpenAIServing, payload: dict | InferRequest) -> list[protocol.Prepared]:
        """The payload's prompts, checked and tokenized on ``serving``'s tokenizer worker with its tokenizer
        (one tokenizer, one thread), so the event loop goes on serving meanwhile."""
        worker = serving.tokenizer_worker
        prepare = protocol.v2_prepare if isinstance(payload, InferRequest) else protocol.v1_prepare
        return await worker.run(prepare, serving, payload, True)

    @staticmethod
    async def _generate(engine: EngineClient, request_id: str, batch: list[protocol.Prepared],
                        lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Submit every prompt, or none (an overloaded engine refuses one: the others are aborted); then wait."""
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(batch):
                streams.append(engine.add_request(f"{request_id}-{i}", p.prompt, p.params, p.priority, p.cache_salt,
                                                  lora_request=lora_request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return await collect(streams)


def no_explainer(name: str) -> InvalidInput:
    return InvalidInput(f"model {name} has no explainer; use :predict, /infer or the OpenAI routes")
