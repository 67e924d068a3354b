"""LoRA's pieces that need no model: --lora-modules parsing, the settings' checks, block-hash keys, KV events,
the request -> adapter resolution of the OpenAI routes, and vllm:lora_requests_info."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from paged_runtime.config import EngineConfig, ServerConfig
from paged_runtime.core.block_hash import block_extra_keys
from paged_runtime.core.kv_events import KVEventRecorder
from paged_runtime.entrypoints.openai.errors import OpenAIError
from paged_runtime.entrypoints.openai.lora_adapters import LoRAAdapters
from paged_runtime.lora.request import LoRAModule, LoRARequest, parse_lora_module_list, parse_lora_modules
from paged_runtime.metrics import IterationStats, LoRAStats, PrometheusStatLogger


def test_lora_modules_take_vllms_two_forms():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}',
                                  {"name": "x", "path": "/a/x"}])
    assert modules == [LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "base"), LoRAModule("x", "/a/x")]
    assert parse_lora_module_list('[{"name": "a", "path": "/p"}, "b=/q"]') == ['{"name": "a", "path": "/p"}', "b=/q"]
    assert parse_lora_module_list("a=/p, b=/q") == ["a=/p", "b=/q"]


@pytest.mark.parametrize("entries,fragment", [
    (["sql"], "expected name=path"), (["=/p"], "expected name=path"), (['{"name": "a"}'], "give a name and a path"),
    (['{"name": "a", "path": "/p", "extra": 1}'], "give a name and a path"), (["{oops"], "not valid JSON"),
    (["a=/p", "a=/q"], "names an adapter twice"),
])
def test_malformed_lora_modules_are_refused(entries, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_lora_modules(entries)
    with pytest.raises(ValueError, match=fragment):
        ServerConfig(lora_modules=entries)


def test_engine_lora_settings():
    assert EngineConfig().lora_config is None
    config = EngineConfig(enable_lora=True, max_loras=4, max_lora_rank=32, max_cpu_loras=8).lora_config
    assert (config.max_loras, config.max_lora_rank, config.cpu_capacity) == (4, 32, 8)
    assert EngineConfig(enable_lora=True, max_loras=3).lora_config.cpu_capacity == 3
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/p")


def test_block_extra_keys_carry_the_adapter_on_every_block_and_the_salt_on_the_first():
    assert block_extra_keys(0, None, None) is None and block_extra_keys(3, None, "s") is None
    assert block_extra_keys(0, None, "s") == ("s",)
    assert block_extra_keys(0, "sql", "s") == ("sql", "s")
    assert block_extra_keys(2, "sql", "s") == ("sql",)


def test_kv_events_name_the_adapter_and_never_merge_across_adapters():
    recorder = KVEventRecorder(16)
    recorder.stored(b"1", None, [1] * 16, 3, "sql")
    recorder.stored(b"2", b"1", [2] * 16, 3, "sql")
    recorder.stored(b"3", b"2", [3] * 16)
    events = recorder.take()
    assert [(e.block_hashes, e.lora_id, e.lora_name) for e in events] == [([b"1", b"2"], 3, "sql"), ([b"3"], None, None)]
    assert events[0].wire(lambda h: h)[4:] == [3, "GPU", "sql"]


def test_a_requests_model_resolves_to_its_base_and_adapter(tmp_path):
    (tmp_path / "dyn").mkdir()
    adapters = LoRAAdapters(["base", "other"], [LoRAModule("sql", "/a/sql"), LoRAModule("o", "/a/o", "other")],
                            enabled=True, dynamic_path=str(tmp_path))
    assert adapters.split("base") == ("base", None)
    assert adapters.split("sql") == ("base", "sql") and adapters.split("o") == ("other", "o")
    assert adapters.split("other:x") == ("other", "x")
    assert adapters.split("dyn") == ("base", "dyn")
    assert adapters.split("nope") == ("nope", None) and adapters.split("../dyn") == ("../dyn", None)
    assert adapters.lookup("base:sql").lora_int_id == 1 and adapters.lookup("base") is None
    assert [e["id"] for e in adapters.listing(0)] == ["sql", "o"]
    assert adapters.listing(0)[1]["parent"] == "other"
    off = LoRAAdapters(["base"])
    assert off.split("sql") == ("sql", None)
    with pytest.raises(ValueError, match="need --enable-lora"):
        LoRAAdapters(["base"], [LoRAModule("sql", "/a")])
    with pytest.raises(ValueError, match="does not serve"):
        LoRAAdapters(["base"], [LoRAModule("sql", "/a", "elsewhere")], enabled=True)


def test_unloading_an_unknown_adapter_is_a_404():
    adapters = LoRAAdapters(["base"], enabled=True, allow_updates=True)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(adapters.unload(lambda base: None, "nope"))
    assert e.value.status == 404 and e.value.code == "lora_adapter_not_found"


def test_lora_requests_info_shows_one_series_with_vllms_labels():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry)

    def series():
        return [(s.labels, s.value) for s in registry.collect() for s in s.samples if s.name == "vllm:lora_requests_info"]
    logger.record(IterationStats(0.0, 2, 1, 0.1, lora=LoRAStats(4, ("a", "b"), ("c",))))
    [(labels, value)] = series()
    assert labels == {"max_lora": "4", "waiting_lora_adapters": "c", "running_lora_adapters": "a,b", "model_name": "m"}
    assert value > 1e9  # the time of the update, as vLLM sets it
    logger.record(IterationStats(0.0, 0, 0, 0.0, lora=LoRAStats(4)))
    assert [labels["running_lora_adapters"] for labels, _ in series()] == [""]
    logger.close()
    assert series() == []
