"""The LoRA adapters a server offers as models of their own (vLLM's ``--lora-modules`` and its LoRA routes).

A request's ``model`` picks an adapter by its name, or as ``base:adapter`` (Ray Serve LLM's spelling, the
adapter named under that base model). Adapters come from three places:

- ``--lora-modules name=path`` (or vLLM's JSON with ``base_model_name``): known from the start;
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``/v1/unload_lora_adapter {"lora_name"}``,
  offered only with ``--allow-runtime-lora-updating`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
- ``--dynamic-lora-loading-path DIR``: a request naming a folder of DIR loads it on first use.

Loading reads and checks the folder on every worker of the base model's engine first (``EngineClient.add_lora``),
so an adapter that cannot run is a 400 with the reason and is never listed. ``--lora-modules`` adapters are read
at start-up (``check_static``: one that cannot run fails the start, as in vLLM) and again by an engine that
loads later (a server of several models), before its first request for them. Unloading stops new requests for
it at once; the engine lets those already running finish. Each adapter gets its engine-wide id when it is
first registered, never reused. Loads of one name run one at a time (two first requests load it once).
"""
from __future__ import annotations

import asyncio
import itertools
import weakref
from dataclasses import dataclass
from pathlib import Path

from paged_runtime.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from paged_runtime.lora.request import LoRAError, LoRAModule, LoRARequest

SEPARATOR = ":"  # "base:adapter"


@dataclass(frozen=True)
class Adapter:
    base: str  # the served name of the model it runs over
    request: LoRARequest


class LoRAAdapters:
    def __init__(self, base_names: list[str], modules: list[LoRAModule] = (), enabled: bool = False,
                 allow_updates: bool = False, dynamic_path: str | None = None) -> None:
        """``base_names``: the served names of the base model(s), the first the default base of an adapter
        that names none. ``enabled``: the engines serve LoRA (else any adapter is refused)."""
        if (modules or dynamic_path) and not enabled:
            raise ValueError("--lora-modules and --dynamic-lora-loading-path need --enable-lora")
        self.base_names, self.enabled, self.allow_updates = list(base_names), enabled, allow_updates
        self.dynamic_path = Path(dynamic_path).expanduser() if dynamic_path else None
        self._ids = itertools.count(1)
        self._by_name: dict[str, Adapter] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> ids it has read
        for module in modules:
            self._register(module.name, module.path, module.base_model_name)

    def _register(self, name: str, path: str, base: str | None = None) -> Adapter:
        base = base or self.base_names[0]
        if base not in self.base_names:
            raise ValueError(f"adapter {name!r} names base model {base!r}, which this server does not serve")
        if name in self.base_names:
            raise ValueError(f"adapter {name!r} has the name of a served model")
        adapter = Adapter(base, LoRARequest(name, next(self._ids), str(path), base))
        self._by_name[name] = adapter
        return adapter

    # ---- resolving a request's model -----------------------------------------------------------------
    def split(self, requested: str | None) -> tuple[str | None, str | None]:
        """(the base model to route to, the adapter name or None) for a request's ``model``."""
        if not self.enabled or requested is None or requested in self.base_names:
            return requested, None
        adapter = self._by_name.get(requested)
        if adapter is not None:
            return adapter.base, requested
        base, sep, name = requested.partition(SEPARATOR)
        if sep and base in self.base_names and name:
            return base, name
        if self._dynamic_folder(requested) is not None:
            return self.base_names[0], requested
        return requested, None  # not an adapter: the model set answers for the name

    def lookup(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (as ``split`` resolves it), if registered."""
        _, name = self.split(requested)
        adapter = self._by_name.get(name) if name is not None else None
        return adapter.request if adapter is not None else None

    async def ensure(self, engine, base: str, name: str) -> LoRARequest:
        """The adapter ``name`` over ``base``, loading it from the dynamic folder on first use; 404 for a name
        that is neither registered nor a folder there, 400 with the reason for one that cannot run."""
        adapter = self._by_name.get(name)
        if adapter is not None:
            if adapter.base != base:
                raise model_not_found(f"{base}{SEPARATOR}{name}")
            await self._read(engine, adapter.request)
            return adapter.request
        folder = self._dynamic_folder(name)
        if folder is None:
            raise model_not_found(f"{base}{SEPARATOR}{name}" if base != self.base_names[0] else name)
        return await self.load(engine, name, str(folder), base, exists_ok=True)

    def _dynamic_folder(self, name: str) -> Path | None:
        """``name``'s folder in the dynamic path, if it is a plain folder name there."""
        if self.dynamic_path is None or not name or name in (".", "..") or "/" in name or "\\" in name:
            return None
        folder = self.dynamic_path / name
        return folder if folder.is_dir() else None

    # ---- loading and unloading -----------------------------------------------------------------------
    async def load(self, engine, name: str, path: str, base: str | None = None,
                   exists_ok: bool = False) -> LoRARequest:
        """Register ``name`` once ``engine`` has read and checked it (400 if the name is taken, unless
        ``exists_ok``, or if the adapter cannot run)."""
        if not self.enabled:
            raise bad_request("LoRA is not enabled on this server: start it with --enable-lora", param="model")
        lock = self._loading.setdefault(name, asyncio.Lock())
        async with lock:
            known = self._by_name.get(name)
            if known is not None:
                if exists_ok:
                    return known.request
                raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                                  code="lora_adapter_exists")
            if name in self.base_names:
                raise bad_request(f"'{name}' is the name of a served model", param="lora_name")
            base = base or self.base_names[0]
            request = LoRARequest(name, next(self._ids), str(Path(path).expanduser()), base)
            await self._read(engine, request)
            self._by_name[name] = Adapter(base, request)
            return request

    async def _read(self, engine, request: LoRARequest) -> None:
        """Have ``engine`` read and check ``request``'s adapter, once per engine."""
        held = self._held.setdefault(engine, set())
        if request.lora_int_id not in held:
            await engine.add_lora(request)
            held.add(request.lora_int_id)

    async def unload(self, engine_of, name: str) -> None:
        """Forget ``name`` (404 if unknown); its running requests finish (``engine_of(base)``: the base's
        engine if loaded, else None: nothing to tell it)."""
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                              code="lora_adapter_not_found")
        engine = engine_of(adapter.base)
        if engine is not None:
            await engine.remove_lora(adapter.request.lora_int_id)

    async def check_static(self, engine_of) -> None:
        """Have each loaded base engine (``engine_of(base)``, None if not loaded) read and check its
        ``--lora-modules`` adapters (at start-up); ``LoRAError`` names the first that cannot run, and why."""
        for name, adapter in list(self._by_name.items()):
            engine = engine_of(adapter.base)
            if engine is None:
                continue
            try:
                await self._read(engine, adapter.request)
            except LoRAError as e:
                raise LoRAError(f"--lora-modules adapter {name!r} ({adapter.request.lora_path}) cannot be served "
                                f"over {adapter.base!r}: {e}") from e

    def read_by(self, engine) -> list[str]:
        """The adapters ``engine`` has read and that are still served (what a replica holds, for routing)."""
        held = self._held.get(engine, set())
        return sorted(name for name, a in self._by_name.items() if a.request.lora_int_id in held)

    # ---- listing --------------------------------------------------------------------------------------
    def listing(self, created: int) -> list[dict]:
        """/v1/models' entries of the adapters: vLLM's, with ``parent`` the base model and ``root`` the folder."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "paged-runtime",
                 "root": a.request.lora_path, "parent": a.base, "max_model_len": None}
                for name, a in sorted(self._by_name.items(), key=lambda item: item[1].request.lora_int_id)]
