"""The declared engine API: front ends reach the engine through ``EngineClient`` only, and importing a
torch-free part of the package does not load torch."""
import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRONT_ENDS = [ROOT / "paged_runtime" / "entrypoints", ROOT / "kserve_adapter", ROOT / "rayserve_adapter"]
INTERNALS = {"core", "processor", "scheduler", "kv_cache", "spec_stats", "model_path"}


def _reaches_inside(node: ast.AST) -> str | None:
    """``x.core`` and friends, or ``engine.engine`` (an engine client's own engine)."""
    if not isinstance(node, ast.Attribute):
        return None
    if node.attr in INTERNALS:
        return f".{node.attr}"
    inner = node.value
    if node.attr == "engine" and (isinstance(inner, ast.Name) and inner.id == "engine"
                                  or isinstance(inner, ast.Attribute) and inner.attr == "engine"):
        return ".engine.engine"
    return None


def test_front_ends_use_only_the_declared_api():
    offences = []
    for folder in FRONT_ENDS:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                what = _reaches_inside(node)
                if what:
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno} {what}")
    assert offences == []


def test_the_checker_catches_what_it_should():
    tree = ast.parse("engine.engine.model_path\nself.engine.engine.step\nllm.engine.core\nengine.processor.x\n"
                     "self.engine.generate\nengine.model_root")
    found = sorted({what for node in ast.walk(tree) if (what := _reaches_inside(node))})
    assert found == [".core", ".engine.engine", ".model_path", ".processor"]


def test_async_engine_implements_every_method_of_the_protocol():
    from paged_runtime.engine.async_engine import AsyncEngine
    from paged_runtime.engine.client import EngineClient
    declared = {name: member for name, member in vars(EngineClient).items()
                if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))}
    assert {"process", "add_request", "generate", "abort", "check_health", "reset_prefix_cache", "set_max_num_seqs",
            "set_max_waiting_requests", "shutdown", "model_root", "vocab_size", "max_num_seqs", "stats",
            "is_healthy"} <= declared.keys()
    for name, member in declared.items():
        if isinstance(member, property):
            continue  # AsyncEngine may hold it as a plain attribute; test_async_engine checks an instance
        ours = getattr(AsyncEngine, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(member).parameters), name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(member), name


@pytest.mark.parametrize("module", ["paged_runtime.core.block_pool", "paged_runtime.engine.client",
                                    "paged_runtime.sampling_params"])
def test_torch_free_modules_do_not_load_torch(module):
    code = f"import sys, {module}; from paged_runtime import SamplingParams; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_public_names_load_on_first_use():
    import paged_runtime
    for name in paged_runtime.__all__:
        assert getattr(paged_runtime, name) is not None, name
    from paged_runtime.entrypoints.llm import LLM
    assert paged_runtime.LLM is LLM and "LLM" in dir(paged_runtime)
    with pytest.raises(AttributeError, match="no_such_name"):
        paged_runtime.no_such_name  # noqa: B018
