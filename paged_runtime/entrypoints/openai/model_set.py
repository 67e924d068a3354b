"""Several models behind one server: each request goes to the engine of the model it names.

A ``ModelSet`` holds one ``ServedModel`` per model: its served names, the path shown as its ``root``, how to
load its engine, and its state, as llama.cpp's router names them: ``unloaded`` -> ``loading`` -> ``loaded``
(or ``error``, with the reason: a later request tries again). With ``max_loaded`` (``--max-loaded-models``) at
most that many engines are loaded at once: a request for an unloaded model loads it on first use, first
unloading the least recently used *idle* model (no request of its own in flight, nobody about to submit
one). When every loaded model is busy, the load waits until one is idle; a client that leaves stops waiting
(the load goes on: the next request finds the model loaded).

Invariants (all on the event loop, no lock across threads): a model's engine is never shut down while a
``use`` of it is open or while it has unfinished requests; loads run one at a time, each first unloading
what it must to fit under ``max_loaded``, so concurrent first requests for several models never load more
than the cap (nor wait on each other's room); one model is loaded at most once at a time (a second request
awaits the first's load).

Loading and unloading run on a worker thread (an engine builds and stops in seconds; the event loop keeps
answering, ``/health`` and ``/v1/models`` included). A single-model server is a set of one loaded model
that never unloads (``ModelSet.single``).

``discover`` finds the models of ``--model A --model B`` and ``--models-dir``: every folder holding a
``config.json`` and every ``.gguf`` file, named by the folder or the file's stem.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio

from paged_runtime.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found

logger = logging.getLogger("paged_runtime.models")

R = TypeVar("R")  # what the routes keep per loaded engine (api.ModelRoutes)
IDLE_POLL_S = 0.02  # how often a load waiting for an idle model looks again (engines do not signal idleness)

UNLOADED, LOADING, LOADED, ERROR = "unloaded", "loading", "loaded", "error"


@dataclass(frozen=True)
class ModelSpec:
    """A model the server offers: the name clients send, and where its weights are."""
    name: str
    path: str


def discover(models: Sequence[str], models_dir: str | None) -> list[ModelSpec]:
    """The models of ``--model`` paths and ``--models-dir`` (its folders with a config.json and its .gguf
    files, sorted by name), named by folder or file stem; ValueError for a missing path, an empty folder or
    two models of one name."""
    paths = [Path(p).expanduser() for p in models]
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise ValueError(f"--models-dir {models_dir!r} is not a folder")
        found = sorted(p for p in root.iterdir() if (p.is_dir() and (p / "config.json").is_file())
                       or (p.is_file() and p.suffix == ".gguf"))
        if not found:
            raise ValueError(f"--models-dir {models_dir!r} holds no model (a folder with a config.json, or a .gguf "
                             "file)")
        paths += found
    specs, seen = [], set()
    for path in paths:
        if not path.exists():
            raise ValueError(f"no model at {str(path)!r}")
        name = path.stem if path.suffix == ".gguf" else path.name
        if name in seen:
            raise ValueError(f"two models are named {name!r}: rename one of their folders or files")
        seen.add(name)
        specs.append(ModelSpec(name, str(path)))
    return specs


@dataclass(eq=False)
class ServedModel(Generic[R]):
    """One model of the set and its engine's life (see the module docstring)."""
    names: list[str]
    root: str
    load: Callable[[], Any] | None  # builds the engine (blocking; on a worker thread); None: never unloads
    engine: Any = None
    routes: R | None = None
    state: str = UNLOADED
    error: str | None = None
    last_used: float = 0.0
    leases: int = 0  # ``use`` blocks open: requests resolving the model, not yet submitted
    load_task: asyncio.Task | None = None  # the load in progress (or the last one), which requests await

    def idle(self) -> bool:
        return self.state == LOADED and self.leases == 0 and self.engine.num_unfinished_requests == 0

    def status(self) -> dict:
        body = {"value": self.state}
        if self.error is not None:
            body["error"] = self.error
        return body


class ModelSet(Generic[R]):
    """The models a server offers, by served name; ``bind`` says how routes are made for a loaded engine."""

    def __init__(self, models: Sequence[ServedModel[R]], max_loaded: int | None = None) -> None:
        if not models:
            raise ValueError("a model set needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError("max_loaded_models must be positive")
        self.models = list(models)
        self.max_loaded = max_loaded
        self._by_name: dict[str, ServedModel[R]] = {}
        for model in self.models:
            for name in model.names:
                if name in self._by_name:
                    raise ValueError(f"two models are served as {name!r}")
                self._by_name[name] = model
        self._make_routes: Callable[[Any, list[str]], R] | None = None
        self._loading = asyncio.Lock()

    @classmethod
    def single(cls, engine: Any, names: Sequence[str], root: str) -> ModelSet[R]:
        """One engine, loaded for good (the caller owns it: ``shutdown`` leaves it running)."""
        return cls.of_engines([(engine, names, root)])

    @classmethod
    def of_engines(cls, engines: Sequence[tuple[Any, Sequence[str], str]]) -> ModelSet[R]:
        """Engines (engine, served names, root) loaded for good by their caller, who owns them."""
        return cls([ServedModel(list(names), root, None, engine, state=LOADED) for engine, names, root in engines])

    @property
    def can_unload(self) -> bool:
        """Whether any model loads and unloads while serving (POST /models/load and /models/unload)."""
        return any(m.load is not None for m in self.models)

    @property
    def is_multi(self) -> bool:
        """More than one model, or one that loads on demand: /v1/models then shows each one's state."""
        return len(self.models) > 1 or self.can_unload

    def bind(self, make_routes: Callable[[Any, list[str]], R]) -> None:
        """How a loaded engine's routes are made (the router's; the loaded engines get theirs now)."""
        self._make_routes = make_routes
        for model in self.models:
            if model.state == LOADED:
                model.routes = make_routes(model.engine, model.names)

    # ---- resolving a request ---------------------------------------------------------------------------
    def find(self, requested: str | None) -> ServedModel[R]:
        """The model a request names: 404 ``model_not_found`` for an unknown name; with several models a
        request must name one (400), with one, no name is that one."""
        if not requested:
            if len(self.models) > 1:
                raise bad_request(f"this server serves {len(self.models)} models: name one in 'model' (GET "
                                  "/v1/models lists them)", param="model")
            return self.models[0]
        model = self._by_name.get(requested)
        if model is None:
            raise model_not_found(requested)
        return model

    @contextlib.asynccontextmanager
    async def use(self, requested: str | None) -> AsyncIterator[R]:
        """The routes of the model a request names, loaded (waiting for its load) and kept loaded while the
        block runs: submit the request's engine requests inside it (they then keep the model busy)."""
        model = self.find(requested)
        model.leases += 1
        try:
            await self._ensure_loaded(model)
            model.last_used = time.monotonic()
            yield model.routes  # type: ignore[misc]
        finally:
            model.leases -= 1

    def load_all_now(self) -> None:
        """Loads every model on the calling thread (a server of several models without a cap, at start)."""
        for model in self.models:
            if model.state != LOADED:
                model.engine, model.state = model.load(), LOADED  # type: ignore[misc]
                if self._make_routes is not None:
                    model.routes = self._make_routes(model.engine, model.names)

    def loaded_engines(self) -> list[Any]:
        return [m.engine for m in self.models if m.state == LOADED]

    def loaded_engine(self, requested: str) -> Any | None:
        """The engine of the model ``requested`` names if it is loaded, else None."""
        model = self.find(requested)
        return model.engine if model.state == LOADED else None

    # ---- loading and unloading -------------------------------------------------------------------------
    async def load(self, requested: str) -> None:
        """Loads a model now (llama.cpp's POST /models/load)."""
        async with self.use(requested):
            pass

    async def unload(self, requested: str) -> None:
        """Unloads a model now (POST /models/unload): a 400 if it is busy or cannot be unloaded."""
        model = self.find(requested)
        if model.load is None:
            raise bad_request(f"model {requested!r} stays loaded: this server loaded it for good at start",
                              param="model")
        if model.state != LOADED:
            raise bad_request(f"model {requested!r} is {model.state}, not loaded", param="model")
        if not model.idle():
            raise OpenAIError(409, f"model {requested!r} has requests in flight; unload it when they finish",
                              param="model", code="model_busy")
        await self._unload(model)

    async def _ensure_loaded(self, model: ServedModel[R]) -> None:
        """Waits for ``model``'s load, starting one if none runs. The load is a task of its own, shielded from
        the requests awaiting it: a client that leaves stops waiting, and the load goes on (an engine half built
        is never dropped, and the next request finds the model loaded)."""
        while model.state != LOADED:
            if model.state != LOADING:
                model.state, model.error = LOADING, None
                model.load_task = asyncio.ensure_future(self._load(model))
            await asyncio.shield(model.load_task)  # type: ignore[arg-type]
            if model.state == ERROR:
                raise OpenAIError(503, f"model {model.names[0]!r} failed to load: {model.error}",
                                  type="server_error", code="model_load_failed")

    async def _load(self, model: ServedModel[R]) -> None:
        try:
            async with self._loading:  # one load at a time: each makes its own room (see the invariants)
                await self._make_room()
                started = time.monotonic()
                engine = await anyio.to_thread.run_sync(model.load)
            model.engine, model.routes = engine, self._make_routes(engine, model.names)  # type: ignore[misc]
            model.state = LOADED
            logger.info("loaded model %s in %.2f s", model.names[0], time.monotonic() - started)
        except Exception as e:
            model.state, model.error = ERROR, f"{type(e).__name__}: {e}"
            logger.error("model %s failed to load: %s", model.names[0], model.error)
        except BaseException:
            model.state = UNLOADED  # the server is stopping: nothing was kept
            raise

    async def _make_room(self) -> None:
        """Unloads least recently used idle models until one more fits under the cap (waiting while every
        loaded model is busy). Called under ``_loading``, so no other model is being loaded meanwhile."""
        while self.max_loaded is not None:
            loaded = [m for m in self.models if m.state == LOADED]
            if len(loaded) < self.max_loaded:
                return
            idle = [m for m in loaded if m.idle()]
            if idle:
                await self._unload(min(idle, key=lambda m: m.last_used))
            else:
                await asyncio.sleep(IDLE_POLL_S)

    async def _unload(self, model: ServedModel[R]) -> None:
        engine, model.engine, model.routes, model.state = model.engine, None, None, UNLOADED
        logger.info("unloading model %s", model.names[0])
        await anyio.to_thread.run_sync(engine.shutdown)

    # ---- the whole set ---------------------------------------------------------------------------------
    def listing(self, created: int) -> list[dict]:
        """/v1/models' entries: every served name of every model; with several models, each with its state."""
        entries = []
        for model in self.models:
            loaded = model.state == LOADED
            for name in model.names:
                entry = {"id": name, "object": "model", "created": created, "owned_by": "paged-runtime",
                         "root": model.engine.model_root if loaded else model.root, "parent": None,
                         "max_model_len": model.engine.max_model_len if loaded else None}
                if self.is_multi:
                    entry["status"] = model.status()
                entries.append(entry)
        return entries

    def check_health(self) -> None:
        """Raises if a loaded engine is unhealthy (a model not loaded has nothing to check)."""
        for engine in self.loaded_engines():
            engine.check_health()

    def shutdown(self) -> None:
        """Stops every engine this set loaded (a ``single`` set's engine is its caller's)."""
        for model in self.models:
            if model.load is not None and model.state == LOADED:
                model.engine.shutdown()
                model.state, model.engine, model.routes = UNLOADED, None, None
