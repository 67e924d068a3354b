"""LoRA adapters on KServe's v1 / v2 routes: each adapter is a KServe model of its own.

``POST /v1/models/ADAPTER:predict``, ``POST /v2/models/ADAPTER/infer``,
``GET /v1/models/ADAPTER``, ``GET /v2/models/ADAPTER[/ready]`` and the
listings (``GET /v1/models``, ``GET /v2/models``, the v2 repository index)
serve and show the adapters the OpenAI routes serve, under the same names.

The registry is the OpenAI app's (``OpenAIRoutes.adapters``), so adapters
loaded or unloaded at runtime (``/v1/load_lora_adapter``, first use from
``--dynamic-lora-loading-path``) appear and go on v1/v2 at once:
``LoRARepository`` looks a name up there on every call instead of keeping
objects, and makes an ``AdapterModel`` (a view over the base model: its
engine, checks and keys, with the adapter on every request). Before the
OpenAI app is built (engines loading), the ``--lora-modules`` adapters are
known from the flags: listed, not ready. An adapter is ready while its base
model is and the OpenAI app is built. A registered model's name wins over an
adapter's. v1/v2 name an adapter plainly (``base:adapter`` is the OpenAI
routes' spelling only). ``--api-key`` guards these routes by path
(``server.ApiKeyMiddleware``), so exactly as the base model's.
"""
from __future__ import annotations

from kserve import Model
from kserve.errors import InvalidInput, ModelNotFound, ModelNotReady
from kserve.model_repository import ModelRepository
from kserve.protocol.infer_type import InferRequest, InferResponse

from kserve_adapter.model import PagedRuntimeModel, no_explainer
from kserve_adapter.openai_routes import OpenAIRoutes
from paged_runtime.engine.client import EngineClient
from paged_runtime.entrypoints.openai.errors import OpenAIError
from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_runtime.lora.request import LoRARequest


class AdapterModel(Model):
    """The LoRA adapter ``name`` over ``base`` (served to the OpenAI routes as ``base_name``), as a KServe model."""

    def __init__(self, name: str, base: PagedRuntimeModel, base_name: str, routes: OpenAIRoutes) -> None:
        super().__init__(name)
        self.base, self.base_name, self.routes = base, base_name, routes
        self.ready = True  # registrable; healthy() says whether it serves
        self.enable_latency_logging = base.enable_latency_logging

    async def healthy(self) -> bool:
        return self.routes.adapters is not None and await self.base.healthy()

    def load(self) -> bool:
        """Nothing of its own to load (KServe's dataplane calls this while the base is not healthy)."""
        return self.ready

    def get_input_types(self) -> list[dict]:
        return self.base.get_input_types()

    def get_output_types(self) -> list[dict]:
        return self.base.get_output_types()

    async def predict(self, payload: dict | InferRequest, headers: dict[str, str] | None = None,
                      response_headers: dict[str, str] | None = None) -> dict | InferResponse:
        return await self.base.run(payload, headers, self.name, self.lora_request)

    async def explain(self, payload: dict, headers: dict[str, str] | None = None) -> dict:
        raise no_explainer(self.name)

    async def lora_request(self, engine: EngineClient) -> LoRARequest:
        """The adapter, read by ``engine`` (loaded from the dynamic folder on first use): 404 once it is
        unloaded, 400 with the reason for one that cannot run (the OpenAI routes' answers, in KServe's shape)."""
        adapters = self.routes.adapters
        if adapters is None:
            raise ModelNotReady(self.name)
        try:
            await adapters.ensure(engine, self.base_name, self.name)
        except OpenAIError as e:
            if e.status == 404:
                raise ModelNotFound(self.name) from e
            if e.status >= 500:
                raise
            raise InvalidInput(e.message) from e
        except ValueError as e:  # LoRAError: the adapter's folder cannot run here
            raise InvalidInput(f"adapter {self.name}: {e}") from e
        request = adapters.lookup(self.name)
        if request is None:  # unloaded while it was read
            raise ModelNotFound(self.name)
        return request


class LoRARepository(ModelRepository):
    """KServe's model repository with the LoRA adapters as models too (see the module docstring).

    ``planned``: the registry of the ``--lora-modules`` adapters made from the flags (``server.main`` checks
    them with it before loading), shown until the OpenAI app, with the registry that serves, is built.
    """

    def __init__(self, routes: OpenAIRoutes, planned: LoRAAdapters | None = None) -> None:
        super().__init__()
        self.routes, self.planned = routes, planned

    def registry(self) -> LoRAAdapters | None:
        served = self.routes.adapters
        return served if served is not None else self.planned

    def get_model(self, name: str) -> Model | None:
        model = super().get_model(name)
        return model if model is not None else self.adapter(name)

    def get_models(self) -> dict[str, Model]:
        """The registered models, then the adapters (in the order they were registered)."""
        models = dict(self.models)
        registry = self.registry()
        for entry in registry.listing(0) if registry is not None else []:
            if entry["id"] not in models and (view := self._view(entry["id"], entry["parent"])) is not None:
                models[entry["id"]] = view
        return models

    def adapter(self, name: str) -> AdapterModel | None:
        """The adapter ``name`` (registered, or a folder of the dynamic path) as a model; None if it is not one."""
        registry = self.registry()
        if registry is None:
            return None
        base_name, adapter = registry.split(name)
        return self._view(name, base_name) if adapter == name else None

    def unload(self, name: str) -> None:
        """KServe's unload for a registered model. An adapter has nothing of its own to stop (ModelServer.stop
        unloads every listed name; its base model's unload stops the engine, ``/v1/unload_lora_adapter``
        forgets the adapter)."""
        if name in self.models or self.adapter(name) is None:
            super().unload(name)  # KeyError for an unknown name, as KServe's

    def _view(self, name: str, base_name: str) -> AdapterModel | None:
        base = next((m for m in self.routes.models if base_name in m.served_model_names), None)
        return AdapterModel(name, base, base_name, self.routes) if base is not None else None
