"""The runtime's OpenAI router on KServe's app, for an engine that does not exist yet when routes are added.

KServe builds its app before any model's engine starts, and the router needs
the engine, so the routes go through one ASGI object: it answers 503 with an
OpenAI error body until the model's engine is up, then builds the runtime's
OpenAI app once and hands it every request. Paths (KServe's OpenAI prefix,
plus the generation and LoRA routes where OpenAI and vLLM clients look
without it)::

    /openai/v1/completions, /openai/v1/chat/completions, /openai/v1/models,
    /openai/health, /openai/version, /openai/tokenize, /openai/detokenize
    /openai/v1/load_lora_adapter, /openai/v1/unload_lora_adapter (--allow-runtime-lora-updating)
    /v1/completions, /v1/chat/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter

LoRA adapters: the app is built with ``enable_lora`` from the engine configs
(``server.py``), since the engines do not exist when the routes are added.
KServe never runs a mounted app's start-up (lifespan), so ``start``, which
each model awaits once its engine is up, builds the app when every engine is
and does it: every ``--lora-modules`` adapter is read and checked on its base
model's engine, and one that cannot run fails the start (as in vLLM), naming
it. ``adapters`` is the app's registry, which the load / unload routes change;
the v1/v2 routes serve the same adapters (``lora.py``).

``/metrics`` is KServe's own (the engine writes to the default registry).
Errors, streaming, the abort on a client's disconnect and the edge checks
(415 unless JSON, 413 beyond the body limit, 400 for lone surrogates or deep
nesting, CORS only for ``allowed_origins``) are the runtime app's.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from kserve_adapter.model import PagedRuntimeModel
from paged_runtime.entrypoints.openai import OpenAIError, build_app
from paged_runtime.entrypoints.openai.access import ApiKeys
from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_runtime.entrypoints.openai.model_set import ModelSet
from paged_runtime.lora.request import LoRAError

OPENAI_PREFIX = "/openai"
ROOT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class AdapterStartError(RuntimeError):
    """A ``--lora-modules`` adapter that cannot be served: the start fails, with the adapter and the reason."""


class OpenAIRoutes:
    """An ASGI app: 503 until every model's engine is up, then the runtime's OpenAI app over those engines (a
    request picks its model by name: ``model_set.py``)."""

    def __init__(self, models: PagedRuntimeModel | Sequence[PagedRuntimeModel],
                 api_key: str | Sequence[str] | ApiKeys | None = None, **app_options: Any) -> None:
        """``app_options``: ``build_app``'s keywords (``allowed_origins``, ``max_request_body_bytes``,
        ``max_prompts_per_request``, the LoRA ones, ``enable_lora`` included), as ``paged-runtime serve`` takes
        them from its flags."""
        self.models = [models] if isinstance(models, PagedRuntimeModel) else list(models)
        self.api_key = api_key
        self.app_options = app_options
        self._app: FastAPI | None = None
        self._model_set: ModelSet | None = None
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self._app or self._build()
        if app is not None:
            await app(scope, receive, send)
        elif scope["type"] == "http":
            loading = next(m.name for m in self.models if m.async_engine is None)
            error = OpenAIError(503, f"The model `{loading}` is loading; retry later.", type="server_error",
                                code="model_not_ready", headers={"Retry-After": "5"})
            await error.response()(scope, receive, send)

    def _build(self) -> FastAPI | None:
        engines = [m.async_engine for m in self.models]
        if any(engine is None for engine in engines):
            return None
        models = ModelSet.of_engines([(engine, m.served_model_names, engine.model_root)
                                      for engine, m in zip(engines, self.models)])
        self._app = build_app(models, api_key=self.api_key, include_metrics=False, **self.app_options)
        self._model_set = models
        return self._app

    @property
    def adapters(self) -> LoRAAdapters | None:
        """The app's LoRA adapters once it is built, else None."""
        return None if self._app is None else self._app.state.lora_adapters

    async def start(self) -> None:
        """Once every model's engine is up (each model awaits this when its own is): build the app and do its
        start-up (see the module docstring); ``AdapterStartError`` for a ``--lora-modules`` adapter that cannot
        run. Before that, and after it once done, nothing."""
        app = self._app or self._build()
        if app is None or self._started:
            return
        await self._check_adapters()
        for handler in app.router.on_startup:  # the router's own (it re-reads the adapters: each once per engine)
            result = handler()
            if inspect.isawaitable(result):
                await result
        self._started = True

    async def _check_adapters(self) -> None:
        """Each ``--lora-modules`` adapter read and checked on its base model's engine."""
        try:
            await self.adapters.check_static(self._model_set.loaded_engine)
        except LoRAError as e:
            raise AdapterStartError(str(e)) from e


def is_openai_path(path: str) -> bool:
    """Whether ``mount_openai_routes`` routes ``path`` to the OpenAI app."""
    return path in ROOT_PATHS or path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def mount_openai_routes(app: FastAPI, routes: OpenAIRoutes) -> None:
    """Adds the paths above to ``app``; call it before the server starts (KServe's routes come after)."""
    app.mount(OPENAI_PREFIX, routes)
    for path in ROOT_PATHS:
        app.add_route(path, routes, methods=["POST"])
