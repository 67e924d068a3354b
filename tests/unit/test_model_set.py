"""ModelSet (several models, one server) over fake engines: which model loads when, which one is unloaded to
make room, that a busy model is never unloaded, that the cap holds under concurrent first requests, and the
errors a client sees. The HTTP side, with real engines: tests/server/test_multi_model_http.py."""
from __future__ import annotations

import asyncio
import threading

import pytest

from paged_runtime.entrypoints.openai.errors import OpenAIError
from paged_runtime.entrypoints.openai.model_set import ModelSet, ServedModel, discover


class FakeEngine:
    alive: list[FakeEngine] = []  # every engine not shut down, across the test (reset per set)

    def __init__(self, name: str) -> None:
        self.name, self.model_root, self.max_model_len = name, f"/models/{name}", 64
        self.num_unfinished_requests = 0
        FakeEngine.alive.append(self)

    def shutdown(self) -> None:
        FakeEngine.alive.remove(self)

    def check_health(self) -> None:
        pass


def make_set(names: str, max_loaded: int | None, fail: set[str] = frozenset()) -> tuple[ModelSet, list[str]]:
    """A set of models named by the letters of ``names``; returns it and the log of loads."""
    FakeEngine.alive = []
    loads: list[str] = []

    def loader(name: str):
        def load() -> FakeEngine:
            loads.append(name)
            if name in fail:
                raise RuntimeError(f"{name} is broken")
            return FakeEngine(name)
        return load

    models = [ServedModel([n], f"/models/{n}", loader(n)) for n in names]
    model_set = ModelSet(models, max_loaded)
    model_set.bind(lambda engine, served: engine)  # the routes are the engine itself here
    return model_set, loads


def states(model_set: ModelSet) -> dict[str, str]:
    return {e["id"]: e["status"]["value"] for e in model_set.listing(0)}


async def request(model_set: ModelSet, name: str) -> FakeEngine:
    async with model_set.use(name) as engine:
        return engine


def run(coro):
    return asyncio.run(coro)


def test_a_model_loads_on_its_first_request_and_the_least_recently_used_idle_one_makes_room():
    async def scenario():
        model_set, loads = make_set("abc", max_loaded=2)
        assert states(model_set) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
        assert (await request(model_set, "a")).name == "a"
        await request(model_set, "b")
        await request(model_set, "a")  # a is now more recent than b
        assert states(model_set) == {"a": "loaded", "b": "loaded", "c": "unloaded"}
        await request(model_set, "c")
        assert states(model_set) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert loads == ["a", "b", "c"] and sorted(e.name for e in FakeEngine.alive) == ["a", "c"]
    run(scenario())


def test_a_busy_model_is_never_unloaded_the_load_waits_until_it_is_idle():
    async def scenario():
        model_set, loads = make_set("ab", max_loaded=1)
        engine_a = await request(model_set, "a")
        engine_a.num_unfinished_requests = 1  # a request of a's still runs
        waiting = asyncio.create_task(request(model_set, "b"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert states(model_set) == {"a": "loaded", "b": "loading"} and loads == ["a"]
        engine_a.num_unfinished_requests = 0
        assert (await waiting).name == "b"
        assert states(model_set) == {"a": "unloaded", "b": "loaded"} and [e.name for e in FakeEngine.alive] == ["b"]
    run(scenario())


def test_a_model_in_use_is_not_unloaded_before_its_request_is_submitted():
    async def scenario():
        model_set, _ = make_set("ab", max_loaded=1)
        async with model_set.use("a"):  # resolving a request of a's: nothing submitted yet
            waiting = asyncio.create_task(request(model_set, "b"))
            for _ in range(20):
                await asyncio.sleep(0)
            assert states(model_set) == {"a": "loaded", "b": "loading"}
        assert (await waiting).name == "b"
    run(scenario())


def test_concurrent_first_requests_never_load_more_than_the_cap():
    async def scenario():
        model_set, loads = make_set("abcd", max_loaded=2)
        most = 0

        async def watch():
            nonlocal most
            while True:
                most = max(most, len(FakeEngine.alive))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        got = await asyncio.gather(*(request(model_set, n) for n in "abcdab"))
        watcher.cancel()
        assert [e.name for e in got] == list("abcdab") and most == 2
        assert sorted(loads[:4]) == list("abcd") and len(FakeEngine.alive) == 2
    run(scenario())


def test_a_second_request_for_a_loading_model_waits_for_the_same_load():
    async def scenario():
        model_set, loads = make_set("a", max_loaded=1)
        first, second = await asyncio.gather(request(model_set, "a"), request(model_set, "a"))
        assert first is second and loads == ["a"]
    run(scenario())


def test_a_client_that_leaves_during_a_load_stops_waiting_and_the_load_goes_on():
    async def scenario():
        model_set, loads = make_set("a", max_loaded=1)
        release = threading.Event()
        slow_load = model_set.models[0].load
        model_set.models[0].load = lambda: (release.wait(30), slow_load())[1]
        leaving = asyncio.create_task(request(model_set, "a"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert states(model_set) == {"a": "loading"}
        leaving.cancel()  # the client went away while the engine was being built
        with pytest.raises(asyncio.CancelledError):
            await leaving
        release.set()
        await model_set.models[0].load_task  # the load was not abandoned: its engine is kept, not leaked
        assert states(model_set) == {"a": "loaded"} and [e.name for e in FakeEngine.alive] == ["a"]
        assert (await request(model_set, "a")).name == "a" and loads == ["a"]  # served without loading again
    run(scenario())


def test_a_failed_load_is_a_503_with_the_reason_and_the_next_request_tries_again():
    async def scenario():
        model_set, loads = make_set("ab", max_loaded=1, fail={"b"})
        with pytest.raises(OpenAIError) as e:
            await request(model_set, "b")
        assert e.value.status == 503 and e.value.code == "model_load_failed" and "b is broken" in e.value.message
        listing = {m["id"]: m["status"] for m in model_set.listing(0)}
        assert listing["b"] == {"value": "error", "error": "RuntimeError: b is broken"}
        with pytest.raises(OpenAIError):
            await request(model_set, "b")
        assert loads == ["b", "b"]
        assert (await request(model_set, "a")).name == "a"  # the others still serve
    run(scenario())


def test_unknown_and_missing_model_names():
    model_set, _ = make_set("ab", max_loaded=None)
    with pytest.raises(OpenAIError) as e:
        model_set.find("c")
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
    assert "`c`" in e.value.message and "/models" not in e.value.message  # no other model's path
    with pytest.raises(OpenAIError) as e:
        model_set.find(None)
    assert (e.value.status, e.value.param) == (400, "model")
    single = ModelSet.single(FakeEngine("only"), ["only"], "/models/only")
    assert single.find(None) is single.models[0] and not single.is_multi
    assert "status" not in single.listing(0)[0]


def test_unloading_by_hand_refuses_a_busy_or_unloaded_model():
    async def scenario():
        model_set, _ = make_set("ab", max_loaded=None)
        engine = await request(model_set, "a")
        engine.num_unfinished_requests = 1
        with pytest.raises(OpenAIError) as e:
            await model_set.unload("a")
        assert (e.value.status, e.value.code) == (409, "model_busy")
        with pytest.raises(OpenAIError) as e:
            await model_set.unload("b")
        assert e.value.status == 400
        engine.num_unfinished_requests = 0
        await model_set.unload("a")
        assert states(model_set) == {"a": "unloaded", "b": "unloaded"} and FakeEngine.alive == []
    run(scenario())


def test_discover_names_folders_and_gguf_files(tmp_path):
    for name in ("beta", "alpha"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "small.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    (tmp_path / "readme.txt").write_text("")
    extra = tmp_path.parent / f"{tmp_path.name}-extra"
    extra.mkdir()
    specs = discover([str(extra)], str(tmp_path))
    assert [(s.name, s.path) for s in specs] == [(extra.name, str(extra)), ("alpha", str(tmp_path / "alpha")),
                                                 ("beta", str(tmp_path / "beta")), ("small", str(tmp_path / "small.gguf"))]
    with pytest.raises(ValueError, match="two models are named 'alpha'"):
        discover([str(tmp_path / "alpha")], str(tmp_path))
    with pytest.raises(ValueError, match="holds no model"):
        discover([], str(tmp_path / "notes"))
    with pytest.raises(ValueError, match="no model at"):
        discover([str(tmp_path / "missing")], None)
