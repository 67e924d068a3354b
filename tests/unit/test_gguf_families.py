"""GGUF files of the newer families convert to folders transformers loads as the original model.

Per family (Qwen2, Qwen3, Qwen3-MoE, Gemma 3, Phi-3 with LongRoPE, Mixtral = llama with experts) a tiny random
HF model is saved with ``save_pretrained`` (the published checkpoint names), then written to GGUF the way
llama.cpp's convert_hf_to_gguf.py does: names from gguf-py's own tensor map, q/k rows permuted for llama,
+1 on Gemma's RMSNorm weights, experts stacked ``[E, ...]``, Phi-3's LongRoPE factors as tensors and its
fused ``qkv_proj``/``gate_up_proj`` kept fused.  ``convert_gguf`` must give back:

1. every saved tensor under its saved name, bit-exact (F32) or exactly gguf-py's dequantisation (Q8_0);
2. a folder transformers loads as the same class, with logits equal to the original's;
3. where transformers reads that GGUF architecture itself (not Mixtral), the same state dict as its own
   GGUF loader -- an independent reader, so a convention the writer and converter share wrongly fails.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from paged_runtime.models import registry  # noqa: E402
from paged_runtime.models.gguf_convert import convert_gguf  # noqa: E402

END_OF_TURN = ["<end_of_turn>", "<|end|>"]  # Gemma's and Phi-3's, at ids 349 and 350
VOCAB = 3 + 256 + 90 + 2  # _byte_level_vocab()
PROMPT = torch.tensor([[1, 5, 90, 300, 2, 17, 42, 348, 77, 100, 12, 3, 8, 310]])
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               initializer_range=0.25)


# --------------------------------------------------------------------------- tiny models


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **_COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_COMMON, intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def _gemma3(**layout):
    # 6 layers: llama.cpp's fixed pattern makes layer 5 global; a window of 4 slides on PROMPT.
    # The global rope is scaled linearly (Gemma 3 4B and up), the local one is not.
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=4, **layout, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))


def _phi3():
    # Partial rotary (12 of 16 dims) and LongRoPE: context 512 over an original 128, so a prompt past
    # 128 tokens switches to the long factors and the cos/sin get the derived attention factor.
    rng = np.random.default_rng(1)
    factors = lambda: [float(x) for x in rng.uniform(1.0, 4.0, 6)]  # noqa: E731
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **_COMMON, intermediate_size=96, num_hidden_layers=2, original_max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "long_factor": factors(), "short_factor": factors()}))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        head_dim=16, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


FAMILIES = {  # GGUF general.architecture -> tiny model builder
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3moe": _qwen3_moe,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "llama": _mixtral,  # llama.cpp writes Mixtral as "llama" with llama.expert_count > 0
}


def _build(arch, **kwargs):
    torch.manual_seed(0)
    model = FAMILIES[arch](**kwargs).float().eval()
    with torch.no_grad():  # HF initialises norms to ones (Gemma's to zeros): spread them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # On a 2^-10 grid, so llama.cpp's +1 for Gemma and our -1 are exact in float32.
                p.copy_(torch.round((torch.rand_like(p) - 0.5) * 1024) / 1024 + (0.0 if arch == "gemma3" else 1.0))
    return model


# --------------------------------------------------------------------------- llama.cpp-style writer


def _permute(w, n_head):
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(saved: dict[str, np.ndarray], arch: str, cfg: dict, stack_experts: bool = True):
    """The saved HF tensors as llama.cpp writes them: (gguf name, array).

    ``stack_experts=False``: the layout before April 2024, ``blk.{i}.ffn_gate.{e}.weight`` per expert."""
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_enum, cfg["num_hidden_layers"])
    stacked: dict[str, dict[int, np.ndarray]] = {}
    for name, a in saved.items():
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            a = _permute(a, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            a = _permute(a, cfg["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + np.float32(1.0)  # Gemma3Model.norm_shift
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:  # llama.cpp stacks experts: model.layers.{i}.<moe>.experts.<w>.weight -> ffn_<w>_exps
            stacked.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = a
            continue
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), a
    for name, experts in stacked.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if stack_experts:
            yield gguf_name, np.stack([experts[e] for e in sorted(experts)])
        else:
            yield from ((gguf_name.replace("_exps.", f".{e}."), a) for e, a in sorted(experts.items()))


def _write_metadata(w, arch: str, cfg: dict, rope: dict):
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    if cfg.get("head_dim") and arch != "phi3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "qwen3moe":
        w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))  # 4.x / 5.x spelling
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "llama":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        if cfg["layer_types"] != transformers.Gemma3TextConfig(num_hidden_layers=cfg["num_hidden_layers"]).layer_types:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        orig = cfg["original_max_position_embeddings"]
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """A tiny GPT-2-style vocabulary: 3 specials, the 256 byte symbols, merges of frequent letters, 2 turn ends.

    Small on purpose: parsing SmolLM2's 49k-token vocabulary takes gguf-py seconds on every read.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    letters = "etaoinshr"
    merges = [f"{a} {b}" for a in letters for b in letters] + [f"\u0120 {a}" for a in letters]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values()]
    return tokens + [m.replace(" ", "") for m in merges] + END_OF_TURN, merges


def _add_tokenizer(w):
    tokens, merges = _byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 5) + [3, 3])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


def _quantize(a: np.ndarray, qtype):
    if qtype == gguf.GGMLQuantizationType.Q8_0 and a.ndim >= 2 and a.shape[-1] % 32 == 0:
        return gguf.quants.quantize(a, qtype), qtype
    return a, None  # norms, factors and odd shapes stay F32, as llama.cpp keeps 1-D tensors F32


def write_gguf(folder, arch: str, path, qtype=gguf.GGMLQuantizationType.F32, stack_experts=True):
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    # transformers 5 spells rope per layer type for Gemma 3: the global layers' entry is what GGUF stores.
    rope = cfg["rope_parameters"].get("full_attention", cfg["rope_parameters"])
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, arch, cfg, rope)
    _add_tokenizer(w)
    for name, a in _gguf_tensors(load_file(str(folder / "model.safetensors")), arch, cfg, stack_experts):
        data, raw = _quantize(np.ascontiguousarray(a, np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module", params=sorted(FAMILIES), ids=lambda arch: "mixtral" if arch == "llama" else arch)
def family(request, tmp_path_factory):
    """(arch, original model, its saved folder, the GGUF, our converted folder)."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{arch}")
    model = _build(arch)
    model.save_pretrained(tmp / "hf")
    gguf_path = tmp / "gguf" / f"tiny-{arch}.gguf"
    gguf_path.parent.mkdir()
    write_gguf(tmp / "hf", arch, gguf_path)
    return arch, model, tmp / "hf", gguf_path, convert_gguf(gguf_path, tmp / "out")


def _tensors(folder):
    from safetensors.numpy import load_file
    return load_file(str(folder / "model.safetensors"))


def test_tensors_equal_saved_checkpoint(family):
    arch, _, hf_dir, _, out = family
    saved, ours = _tensors(hf_dir), _tensors(out)
    assert ours.keys() == saved.keys()
    for name in saved:
        assert ours[name].dtype == np.float32
        assert np.array_equal(ours[name], saved[name]), name


def test_transformers_loads_folder_with_equal_logits(family):
    arch, model, _, _, out = family
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(loaded) is type(model)
    ids = torch.cat([PROMPT, PROMPT.flip(1)] * 6, dim=1) if arch == "phi3" else PROMPT  # phi3: past 128
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_config_keys(family):
    arch, model, hf_dir, _, out = family
    cfg, saved = json.loads((out / "config.json").read_text()), json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == saved["architectures"] and cfg["model_type"] == saved["model_type"]
    keys = {"qwen2": ["intermediate_size", "tie_word_embeddings"],
            "qwen3": ["head_dim", "tie_word_embeddings"],
            "qwen3moe": ["num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"],
            "gemma3": ["sliding_window", "layer_types", "query_pre_attn_scalar", "head_dim", "hidden_activation"],
            "phi3": ["original_max_position_embeddings", "max_position_embeddings", "tie_word_embeddings"],
            "llama": ["num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim"]}[arch]
    assert {k: cfg[k] for k in keys} == {k: saved[k] for k in keys}
    eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos == {"gemma3": [2, 349], "phi3": [2, 350]}.get(arch, 2)  # chat turns end there too
    if arch == "gemma3":
        assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
        assert cfg["rope_local_base_freq"] == 1e4 and cfg["rope_theta"] == 1e6
    if arch == "phi3":
        rope = saved["rope_parameters"]
        assert cfg["partial_rotary_factor"] == 0.75 and cfg["rope_scaling"]["rope_type"] == "longrope"
        for k in ("long_factor", "short_factor"):
            assert np.array_equal(np.float32(cfg["rope_scaling"][k]), np.float32(rope[k]))
        assert "attention_factor" not in cfg["rope_scaling"]  # the derived one: HF recomputes it


def test_matches_transformers_gguf_loader(family):
    arch, _, _, gguf_path, out = family
    if arch == "llama":
        pytest.skip("transformers reads a llama GGUF as Llama: it drops Mixtral's experts")
    # Shapes from our config.json: transformers' GGUF config reader ignores e.g. qwen3's key_length
    # (head_dim); the tensors, the point here, come from its own reader and dequantiser.
    config = transformers.AutoConfig.from_pretrained(str(out))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32, local_files_only=True)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == our_sd.keys()
    for name in ref_sd:
        assert torch.equal(ref_sd[name], our_sd[name]), name


def test_tokenizer_files_equal_transformers_own(family, tmp_path):
    """The tokenizer is the one transformers' AutoTokenizer makes of the same GGUF, file for file.

    The converter picks its class from the family's model type; the class matters (Gemma's and Qwen's
    write other files than the generic one)."""
    _, _, _, gguf_path, out = family
    ref = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    ref.save_pretrained(tmp_path)
    assert (out / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    ours, theirs = (json.loads((d / "tokenizer_config.json").read_text()) for d in (out, tmp_path))
    patched = {"tokenizer_class", "add_bos_token", "add_eos_token", "chat_template", "is_local", "local_files_only"}
    assert {k: v for k, v in ours.items() if k not in patched} == {
        k: v for k, v in theirs.items() if k not in patched}


def test_conversion_reads_the_file_once(family, tmp_path, monkeypatch):
    """gguf-py's reader parses every metadata array on open (seconds for a 49k-token vocabulary):
    learning the tokenizer's class must not open the file a second time."""
    opened = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            opened.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    convert_gguf(family[3], tmp_path / "out")
    assert len(opened) == 1


def test_gemma3_layer_pattern_from_the_file(tmp_path):
    """A file that states its per-layer sliding pattern overrides llama.cpp's every-6th default."""
    sliding, full = "sliding_attention", "full_attention"
    layer_types = [sliding, full, sliding, sliding, full, full]
    model = _build("gemma3", layer_types=layer_types)
    model.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", "gemma3", tmp_path / "g.gguf")
    out = convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == layer_types and "sliding_window_pattern" not in cfg
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, loaded(PROMPT).logits)


def test_mixtral_with_one_tensor_per_expert(tmp_path):
    """Mixtral GGUFs made before llama.cpp stacked experts (blk.{i}.ffn_gate.{e}.weight) convert the same."""
    model = _build("llama")
    model.save_pretrained(tmp_path / "hf")
    write_gguf(tmp_path / "hf", "llama", tmp_path / "old.gguf", stack_experts=False)
    assert "blk.1.ffn_down.3.weight" in {t.name for t in gguf.GGUFReader(tmp_path / "old.gguf").tensors}
    out = convert_gguf(tmp_path / "old.gguf", tmp_path / "out")
    saved, ours = _tensors(tmp_path / "hf"), _tensors(out)
    assert ours.keys() == saved.keys()
    assert all(np.array_equal(ours[k], saved[k]) for k in saved)


def test_q8_0_equals_gguf_dequantization(tmp_path):
    """A quantised file: weights are gguf-py's dequantisation, and match transformers' own reader."""
    model = _build("qwen3")
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "q8.gguf"
    write_gguf(tmp_path / "hf", "qwen3", path, gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(path, tmp_path / "out")
    saved, ours = _tensors(tmp_path / "hf"), _tensors(out)
    quantised = 0
    for name, a in saved.items():
        expected, raw = _quantize(a, gguf.GGMLQuantizationType.Q8_0)
        if raw is not None:
            expected = gguf.quants.dequantize(expected, raw)
            quantised += 1
        assert np.array_equal(ours[name], expected), name
    assert quantised == 1 + 2 * 7  # embedding + q/k/v/o/gate/up/down per layer
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=loaded.config, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        assert torch.equal(ref(PROMPT).logits, loaded(PROMPT).logits)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = tmp_path / "olmoe.gguf"
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as err:
        convert_gguf(path, tmp_path / "out")
    assert "unsupported GGUF architecture 'olmoe'" in str(err.value)
    for arch in ("gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe"):
        assert repr(arch) in str(err.value)
    assert set(registry.gguf_architectures()) == {"gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3moe"}


# --------------------------------------------------------------------------- the runtime on a converted GGUF


@pytest.mark.parametrize("arch", sorted(FAMILIES), ids=lambda arch: "mixtral" if arch == "llama" else arch)
def test_runtime_serves_q8_0_gguf_like_transformers(arch, tmp_path, monkeypatch):
    """LLM(model="x.gguf") converts on first use and serves greedy tokens identical to transformers on the
    converted folder, with chunked prefill, a shared prefix (cache hits), preemption and n = 2, for every
    family.  Q8_0, as published GGUFs are quantised (F32 files differ only in the bytes dequantised)."""
    from tests.conftest import assert_idle, hf_greedy, make_llm
    from paged_runtime import SamplingParams

    model = _build(arch)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(tmp_path / "hf", arch, path, gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setenv("PAGED_RUNTIME_CACHE", str(tmp_path / "cache"))
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    block_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4 * 16  # K and V, fp32, 16 tokens
    # 10 blocks is too few for the batch: requests are preempted and recomputed.
    # The blocks multiplied by their torch definition (cpu_kernels=False), which computes exactly the dequantized
    # weights; the compiled kernels round activations to 8 bits (test_gguf_blocks_served.py bounds them).
    llm = make_llm(path, max_model_len=160, max_num_batched_tokens=24, max_num_seqs=4,
                   kv_cache_memory=10 * block_bytes, block_size=16, cpu_kernels=False)
    assert type(llm.engine.core.runner.model) is registry.family(type(model).__name__).model_class
    (converted,) = (d for d in (tmp_path / "cache").iterdir() if (d / "config.json").exists())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    shared = rng.integers(3, VOCAB, 40).tolist()
    prompts = [shared + rng.integers(3, VOCAB, n).tolist() for n in (1, 9, 30)] + [rng.integers(3, VOCAB, 70).tolist()]
    params = [SamplingParams(max_tokens=12, temperature=0, n=2 if i == 0 else 1) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0 and core.kv_cache.num_hit_tokens > 0
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(hf, prompt, 12)
        assert [c.token_ids for c in out.outputs] == [expected] * len(out.outputs)
    assert_idle(llm)
