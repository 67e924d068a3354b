"""``python -m paged_runtime serve``: flags, start-up, a request, the API key from the environment, clean exit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from paged_runtime.entrypoints.cli import build_parser, engine_config, server_config
from paged_runtime.settings import parse_bytes

from .conftest import free_socket

VLLM_FLAGS = ["--host", "--port", "--served-model-name", "--api-key", "--dtype", "--max-model-len", "--max-num-seqs",
              "--max-num-batched-tokens", "--block-size", "--kv-cache-memory", "--gpu-memory-utilization",
              "--enable-prefix-caching", "--no-enable-prefix-caching", "--seed", "--max-waiting-requests",
              "--scheduling-policy", "--tensor-parallel-size", "--speculative-config", "--enforce-eager"]


def test_serve_flags_and_defaults():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    options = {s for action in serve._actions for s in action.option_strings}
    assert set(VLLM_FLAGS) <= options
    args = build_parser().parse_args(["serve"])
    config, server = engine_config(args), server_config(args)
    assert (config.model, server.host, server.port, config.enable_prefix_caching) == (None, "127.0.0.1", 8000, True)
    args = build_parser().parse_args(["serve", "/m", "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB"])
    config = engine_config(args)
    assert (config.model, config.enable_prefix_caching, config.kv_cache_memory) == ("/m", False, 2 * 2**30)
    assert engine_config(build_parser().parse_args(["serve", "--model", "/n"])).model == "/n"  # vLLM's flag too
    assert engine_config(build_parser().parse_args(["serve", "--enforce-eager"])).enforce_eager
    assert not engine_config(args).enforce_eager


def test_speculative_config_flag_reaches_the_engine_config():
    from paged_runtime.entrypoints.cli import engine_config
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'])
    spec = engine_config(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
        ("ngram", 3, 1, 2)
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        engine_config(build_parser().parse_args(["serve", "--speculative-config", "{ngram"]))


@pytest.mark.parametrize("text,value", [("1024", 1024), ("512MiB", 512 * 2**20), ("2G", 2 * 2**30), ("1.5k", 1536)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def run_cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "paged_runtime", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}, **kwargs)


@pytest.mark.server
def test_bad_flags_exit_2_without_loading():
    proc = run_cli("serve", "--tensor-parallel-size", "2", "--async-scheduling")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "async_scheduling needs one device" in out
    proc = run_cli("serve", "/no/such/model")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "does not exist" in out
    proc = run_cli("serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}')
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "speculative_config.method must be one of" in out
    proc = run_cli("serve", "--enable-auto-tool-choice")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in out


def test_the_parser_flags_offer_exactly_the_registered_parsers():
    from paged_runtime import config
    from paged_runtime.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from paged_runtime.entrypoints.openai.tool_parsers import TOOL_PARSERS
    assert set(config.TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(config.REASONING_PARSERS) == set(REASONING_PARSERS)
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral",
                                      "--reasoning-parser", "deepseek_r1"])
    from paged_runtime.entrypoints.cli import server_config
    from paged_runtime.entrypoints.openai import app_options
    options = app_options(server_config(args))["chat_options"]
    assert (options.enable_auto_tool_choice, options.tool_call_parser, options.reasoning_parser) == (
        True, "mistral", "deepseek_r1")


@pytest.mark.server
def test_serve_end_to_end(tiny_llama_dir):
    sock = free_socket()  # reserve a free port number, then let the server bind it
    port = sock.getsockname()[1]
    sock.close()
    proc = run_cli("serve", str(tiny_llama_dir), "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
                   "--kv-cache-memory", "8MiB", "--served-model-name", "tiny", "--log-stats-interval", "0.05",
                   env={"PAGED_RUNTIME_API_KEY": "env-key"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer env-key"}
        assert httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 100
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Avg generation throughput" in out and "Running:" in out and "KV cache usage" in out


# ---- vLLM's launch lines (issue 17) ------------------------------------------------------------
def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def server(*argv: str):
    return server_config(serve_args(*argv))


def test_vllm_spellings_parse_to_the_runtime_settings():
    args = serve_args("--kv-cache-memory-bytes", "1GiB", "--disable-log-requests", "--uvicorn-log-level", "debug",
                      "--max-logprobs", "5", "--generation-config", "vllm")
    config, settings = engine_config(args), server_config(args)
    assert (config.kv_cache_memory, settings.disable_log_requests, settings.uvicorn_log_level) == (2**30, True, "debug")
    assert (config.kv_cache_memory, config.max_logprobs, config.generation_config) == (2**30, 5, "vllm")
    config, settings = engine_config(serve_args()), server()
    assert (settings.allowed_origins, settings.uvicorn_log_level, settings.chat_template, config.max_logprobs,
            config.generation_config, settings.disable_log_requests) == (None, None, None, 20, "auto", False)


@pytest.mark.parametrize("argv,origins", [
    (["https://a", "https://b"], ["https://a", "https://b"]),
    (['["https://a", "https://b"]'], ["https://a", "https://b"]),  # vLLM's JSON list
    (['["*"]'], ["*"]),
])
def test_allowed_origins_plain_or_as_vllm_json(argv, origins):
    assert server("--allowed-origins", *argv).allowed_origins == origins


def test_allowed_origins_bad_json_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_args("--allowed-origins", '["https://a", 3]')
    assert exit_info.value.code == 2
    assert "is not a JSON list of origins" in capsys.readouterr().err


def test_chat_template_from_a_file_or_inline(tmp_path, capsys):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert server("--chat-template", str(path)).chat_template == "{{ messages[0]['content'] }}"
    assert server("--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}").chat_template == \
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(SystemExit) as exit_info:
        serve_args("--chat-template", str(tmp_path / "missing.jinja"))
    assert exit_info.value.code == 2
    assert "is neither a readable file nor a Jinja template" in capsys.readouterr().err


@pytest.mark.parametrize("env,key", [
    ({}, None), ({"VLLM_API_KEY": "v"}, ["v"]), ({"PAGED_RUNTIME_API_KEY": "p", "VLLM_API_KEY": "v"}, ["p"]),
])
def test_api_key_from_the_flag_then_the_projects_variable_then_vllms(env, key, monkeypatch):
    monkeypatch.delenv("PAGED_RUNTIME_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert server().api_key == key
    assert server("--api-key", "flag").api_key == ["flag"]
    assert server("--api-key", "k1", "k2").api_key == ["k1", "k2"]


# ---- several models, one server (issue 37) -----------------------------------------------------
def test_several_models_get_one_config_each_with_their_names_and_a_share_of_the_kv_budget(two_models_dir):
    import torch

    from paged_runtime.entrypoints.cli import engine_configs
    from paged_runtime.worker.kv_budget import free_memory
    alpha, beta = str(two_models_dir / "alpha"), str(two_models_dir / "beta")
    for argv in (["serve", alpha, "--model", beta], ["serve", "--model", alpha, "--model", beta],
                 ["serve", "--models-dir", str(two_models_dir)]):
        args = build_parser().parse_args([*argv, "--max-num-seqs", "8"])
        configs = engine_configs(args, server_config(args))
        assert [(c.model, c.served_model_names, c.max_num_seqs) for c in configs] == [
            (alpha, ["alpha"], 8), (beta, ["beta"], 8)], argv
        share = free_memory(torch.device("cpu"), 1.0) // 2
        assert all(abs(c.kv_cache_memory - share) < 64 * 2**20 for c in configs)  # MemAvailable moves a little
    args = serve_args("--models-dir", str(two_models_dir), "--max-loaded-models", "1", "--kv-cache-memory", "8MiB")
    assert [c.kv_cache_memory for c in engine_configs(args, server_config(args))] == [8 * 2**20] * 2  # per model
    args = serve_args("--model", alpha, "--model", beta, "--served-model-name", "x")
    with pytest.raises(ValueError, match="--served-model-name names one model"):
        engine_configs(args, server_config(args))
    with pytest.raises(ValueError, match="2 models are named"):
        engine_config(serve_args("--model", alpha, "--model", beta))
