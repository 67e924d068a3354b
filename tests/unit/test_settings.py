"""The settings schema: each setting declared once (``paged_runtime/config.py``), every front end generated from it.

Every engine field reaches ``paged-runtime serve``, the KServe adapter, Ray Serve's ``AppArgs`` and ``LLM(...)``
with the same default, and a value set on each front end arrives in the ``EngineConfig`` it builds.
"""
from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from kserve_adapter.args import parse_args as kserve_args
from paged_runtime.config import EngineConfig, ServerConfig
from paged_runtime.entrypoints.cli import build_parser, engine_config, server_config
from paged_runtime.entrypoints.llm import LLM
from paged_runtime.settings import _base, flag_name, settings_of
from rayserve_adapter.args import AppArgs

ENV = ("PAGED_RUNTIME_CACHE", "PAGED_RUNTIME_CPU_KERNELS", "PAGED_RUNTIME_CPU_ISA", "PAGED_RUNTIME_ATTENTION_BACKEND",
       "PAGED_RUNTIME_API_KEY", "VLLM_API_KEY")
# A front end that decides a field itself, and why: the InferenceService's name is its served name, its model is
# what --model_dir (KServe's storageUri mount) holds.
KSERVE_OWN = {"served_model_name", "model"}


@pytest.fixture(autouse=True)
def no_environment(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def serve(*argv: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["serve", *argv]))


def kserve(*argv: str) -> EngineConfig:
    return engine_config(kserve_args(["--model_name", "m", *argv]))


def ray(**values) -> EngineConfig:
    return AppArgs.model_validate(values).engine_config()


def engine_fields():
    return [(f, spec, annotation) for f, spec, annotation in settings_of(EngineConfig)]


def test_every_engine_field_is_a_setting_and_llm_takes_each_as_a_keyword():
    assert [f.name for f, _, _ in engine_fields()] == [f.name for f in dataclasses.fields(EngineConfig)]
    params = list(inspect.signature(LLM.__init__).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "model"] and params[2].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineConfig)])
def test_every_engine_field_has_the_same_default_on_every_front_end(name):
    default = getattr(EngineConfig(), name)
    assert getattr(serve(), name) == default
    assert getattr(ray(), name) == default
    if name not in KSERVE_OWN:
        assert getattr(kserve(), name) == default
    serve_flags = {s for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
                   for s in a.option_strings}
    assert flag_name(name) in serve_flags and name in AppArgs.model_fields


def sample(f: dataclasses.Field, spec, annotation) -> tuple[str, object] | None:
    """A valid value other than the default, as text and as the config holds it (None: no generic one)."""
    base, _ = _base(annotation)
    default = f.default
    if spec.choices:
        value = next(c for c in reversed(spec.choices) if c != default)
        return value, value
    if base is int:
        value = int(max(spec.ge or 1, spec.gt or 0, default or 0)) + 3
        return str(value), value
    if base is float:
        value = spec.le / 2 if spec.le else (default or 1) + 0.5
        return str(value), value
    return None


@pytest.mark.parametrize("name", [f.name for f, spec, a in engine_fields() if sample(f, spec, a) is not None])
def test_a_value_set_on_each_front_end_arrives_in_the_engine_config(name):
    f, spec, annotation = next(x for x in engine_fields() if x[0].name == name)
    text, value = sample(f, spec, annotation)
    flag = f"{flag_name(name)}={text}"
    assert getattr(serve(flag), name) == value
    assert getattr(kserve(flag), name) == value
    assert getattr(ray(**{name: text}), name) == value  # serve run ... key=value hands strings over
    assert getattr(EngineConfig(**{name: value}), name) == value


@pytest.mark.parametrize("name", [f.name for f, _, a in engine_fields() if _base(a)[0] is bool])
def test_switches_turn_on_and_off_on_every_front_end(name):
    assert (getattr(serve(flag_name(name)), name), getattr(serve("--no-" + flag_name(name)[2:]), name)) == (True, False)
    assert getattr(kserve("--no-" + flag_name(name)[2:]), name) is False
    assert getattr(ray(**{name: "false"}), name) is False


def test_a_value_out_of_bounds_is_refused_the_same_way_everywhere(capsys):
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        AppArgs(max_num_seqs=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "0"])
    assert "max_num_seqs must be positive, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_server_settings_reach_the_front_ends_that_show_them():
    for f, spec, _ in settings_of(ServerConfig):
        default = getattr(ServerConfig(), f.name)
        if "serve" in spec.front_ends:
            assert getattr(server_config(build_parser().parse_args(["serve"])), f.name) == default
        if "ray" in spec.front_ends:
            assert getattr(AppArgs().server_config(), f.name) == default
        if "kserve" in spec.front_ends:
            assert getattr(server_config(kserve_args(["--model_name", "m"])), f.name) == default


def test_environment_backed_defaults_are_read_when_a_config_is_built(monkeypatch):
    monkeypatch.setenv("PAGED_RUNTIME_CPU_KERNELS", "0")
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert (EngineConfig().cpu_kernels, serve().cpu_kernels, ray().cpu_kernels) == (False, False, False)
    assert (ServerConfig().api_key, AppArgs().server_config().api_key) == (["v"], ["v"])
    assert serve("--cpu-kernels").cpu_kernels is True  # a flag wins over the environment
    assert AppArgs(api_key="k1, k2", allowed_hosts="a.internal b.internal").server_config().allowed_hosts == [
        "a.internal", "b.internal"]
    assert AppArgs(api_key="k1, k2").server_config().api_key == ["k1", "k2"]  # a list given as one text


def test_the_cpu_isa_is_one_setting_backed_by_its_variable(monkeypatch, capsys):
    """--cpu-isa / $PAGED_RUNTIME_CPU_ISA picks the kernels' build among kernels/cpu.ISAS' names (best first);
    another name is refused when a config is built (one this CPU lacks when the kernels load:
    test_kernel_cache.py)."""
    assert (EngineConfig().cpu_isa, serve().cpu_isa) == ("auto", "auto")
    monkeypatch.setenv("PAGED_RUNTIME_CPU_ISA", "avx2")
    assert (EngineConfig().cpu_isa, serve().cpu_isa, kserve().cpu_isa, ray().cpu_isa) == ("avx2",) * 4
    assert serve("--cpu-isa", "avx512_vnni").cpu_isa == "avx512_vnni"  # a flag wins over the environment
    with pytest.raises(ValueError, match="cpu_isa must be one of auto, amx, avx512_vnni, avx512, avx_vnni, avx2, "
                                         "scalar; "
                                         "got 'avx1024'"):
        EngineConfig(cpu_isa="avx1024")
    monkeypatch.setenv("PAGED_RUNTIME_CPU_ISA", "sse4")
    with pytest.raises(ValueError, match="cpu_isa must be one of .*; got 'sse4'"):
        EngineConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpu-isa", "avx1024"])
    assert "invalid choice: 'avx1024'" in capsys.readouterr().err


def test_help_never_shows_a_secret(monkeypatch):
    monkeypatch.setenv("PAGED_RUNTIME_API_KEY", "s3cret")
    out = subprocess.run([sys.executable, "-m", "paged_runtime", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "s3cret" not in out and "$PAGED_RUNTIME_API_KEY, else $VLLM_API_KEY" in out
    assert "MISSING" not in out  # an environment-backed setting shows the value it falls back to
    assert "$PAGED_RUNTIME_CACHE, else '~/.cache/paged_runtime'" in " ".join(out.split())
    assert "engine" in out and "server" in out and "parallelism" in out  # grouped as declared


def test_the_schema_modules_import_no_torch():
    code = ("import sys; import paged_runtime.config, paged_runtime.settings, rayserve_adapter.args; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_implementations_serve_exactly_the_declared_choices():
    """Each choice is declared once, in the settings; the modules that implement them cover exactly those."""
    from paged_runtime import config
    from paged_runtime.attention import BACKENDS, BUILDERS, ENCODER
    from paged_runtime.core.scheduler import SCHEDULING_POLICIES
    from paged_runtime.kernels.cpu import ISAS
    from paged_runtime.kernels.kv_quant import CACHE_DTYPES
    from paged_runtime.layers.quantization import NAMES
    assert set(SCHEDULING_POLICIES) == set(config.SCHEDULING_POLICIES)
    # encoder: not a choice, the backend of every encoder-only model (attention/__init__.py's select_backend)
    assert set(BACKENDS) == set(config.ATTENTION_BACKENDS) and set(BUILDERS) == {*BACKENDS, ENCODER}
    assert tuple(CACHE_DTYPES) == config.KV_CACHE_DTYPES and NAMES == config.QUANTIZATIONS
    assert tuple(ISAS) == config.CPU_ISAS
