"""A .gguf model is served from its own blocks (``--quantization gguf``, the default for a GGUF): for every
served type, greedy tokens equal the same file dequantized at load (``--quantization none``), the resident
weights are the file's bytes, a fused matrix of mixed types multiplies per run of one type, and an unserved
type is refused naming it and the served ones (``none`` still serves it).

The tiny Qwen3 (hidden 256, so K-quant rows of 256 fit) is written with random but valid blocks: each
block's scales are set, its quants random, so every type's dequantization is exercised as the file holds it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tests.conftest import make_llm  # noqa: E402
from tests.helpers.gguf_blocks import random_blocks  # noqa: E402
from paged_runtime import SamplingParams  # noqa: E402
from paged_runtime.layers.quantization.gguf_blocks import SERVED, dequantize  # noqa: E402
from test_gguf_families import _COMMON, _add_tokenizer, _gguf_tensors, _write_metadata  # noqa: E402

pytestmark = [pytest.mark.slow]

Q = gguf.GGMLQuantizationType
@pytest.mark.parametrize("qtype", sorted(SERVED))
def test_torch_dequantization_is_gguf_py_s_bit_for_bit(qtype):
    """The torch definition (the CUDA path, and the kernels' oracle) equals the gguf package's."""
    raw = random_blocks(7, 512, qtype, np.random.default_rng(2))
    want = gguf.quants.dequantize(raw, Q[qtype]).reshape(7, 512)
    assert np.array_equal(dequantize(torch.from_numpy(raw), SERVED[qtype]).numpy(), want)


def _tiny_qwen3():
    torch.manual_seed(0)
    common = {**_COMMON, "hidden_size": 256}
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **common, intermediate_size=512, num_hidden_layers=2, head_dim=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})).float().eval()


def write_gguf(tmp_path, types) -> tuple:
    """The tiny Qwen3 as a GGUF whose 2-D weights are blocks of ``types(gguf_name)`` (None: float32);
    returns (path, {gguf name: raw bytes written})."""
    import json
    from safetensors.numpy import load_file
    model = _tiny_qwen3()
    model.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    _write_metadata(w, "qwen3", cfg, cfg["rope_parameters"])
    _add_tokenizer(w)
    rng, written = np.random.default_rng(0), {}
    for name, a in _gguf_tensors(load_file(str(tmp_path / "hf" / "model.safetensors")), "qwen3", cfg):
        qtype = types(name) if a.ndim == 2 else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(a, np.float32))
            continue
        written[name] = random_blocks(a.shape[0], a.shape[1], qtype, rng)
        w.add_tensor(name, written[name], raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, written


def greedy(llm) -> list[list[int]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 340, n).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def engines(path) -> dict:
    """The file served from its blocks by the compiled kernels (steps of 16 tokens: several passes never
    needed), by the torch definition (kernels off), and dequantized at load (the oracle)."""
    common = dict(max_model_len=96, kv_cache_memory=4 << 20, max_num_batched_tokens=16)
    return {"kernels": make_llm(path, **common), "torch": make_llm(path, cpu_kernels=False, **common),
            "plain": make_llm(path, quantization="none", **common)}


# The kernels round activations to int8 per 32 inputs (as llama.cpp); that rounding, not the machine, sets the
# gap from the dequantized weights: the integer dot products are exact and their float order is the same on every
# ISA (test_gguf_kernels checks scalar, AVX2 and a baseline build bit for bit), so the measured 0.03-0.24 nats
# (scored logprobs average about -9 on this random model) hold on every CPU. A wrong block layout or scale moves
# them by nats: 0.35 separates the two.
ACTIVATION_ROUNDING_GAP = 0.35


def scored(llm) -> np.ndarray:
    from paged_runtime.utils.perplexity import prompt_logprobs
    return np.array(prompt_logprobs(llm, np.random.default_rng(4).integers(3, 340, 64).tolist(), 64))


@pytest.mark.parametrize("qtype", sorted(SERVED))
def test_each_served_type_computes_as_its_dequantized_weights(qtype, tmp_path, private_cache):
    """The torch definition computes exactly the dequantized model (token for token); the kernels round
    activations to 8 bits per block of 32 (as llama.cpp), so their logprobs stay within a bound instead."""
    path, written = write_gguf(tmp_path, lambda name: qtype)
    llms = engines(path)
    model = llms["kernels"].engine.core.runner.model
    held = {n: b for n, b in model.named_buffers() if ".qweight_" in n}
    assert sum(b.nbytes for b in held.values()) == sum(r.nbytes for r in written.values())  # embedding tied
    assert not any(n.endswith("proj.weight") for n, _ in model.named_parameters())
    assert greedy(llms["torch"]) == greedy(llms["plain"])
    gap = np.abs(scored(llms["kernels"]) - scored(llms["plain"])).max()
    print(f"{qtype}: largest prompt-logprob gap, kernels vs dequantized: {gap:.4f}")
    assert gap <= ACTIVATION_ROUNDING_GAP, gap


def test_a_fused_matrix_of_mixed_types_multiplies_per_run(tmp_path, private_cache):
    """As Q4_K_M files: attn_v and ffn_up in Q6_K beside Q4_K; q / k join one segment, v is another."""
    path, _ = write_gguf(tmp_path, lambda name: "Q6_K" if ("attn_v" in name or "ffn_up" in name) else "Q4_K")
    llms = engines(path)
    qkv = llms["torch"].engine.core.runner.model.layers[0].self_attn.qkv_proj
    assert [(t.name, rows) for t, rows, _ in qkv.gguf_segments] == [("Q4_K", 256 + 128), ("Q6_K", 128)]
    assert greedy(llms["torch"]) == greedy(llms["plain"])
    assert np.abs(scored(llms["kernels"]) - scored(llms["plain"])).max() <= ACTIVATION_ROUNDING_GAP


def test_an_unserved_type_is_refused_naming_it(tmp_path, private_cache):
    path, _ = write_gguf(tmp_path, lambda name: None)
    # Rewrite one weight as TQ1_0 (ternary), which gguf-py quantizes and dequantizes but the runtime does not serve.
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "tq.gguf"), "qwen3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if field.types[0] ==
                        gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        a = np.asarray(t.data)
        if t.name == "blk.0.attn_q.weight":
            w.add_tensor(t.name, gguf.quants.quantize(a, Q.TQ1_0), raw_dtype=Q.TQ1_0)
        else:
            w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight is stored as TQ1_0.*"
                       "served types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.*--quantization none"):
        make_llm(tmp_path / "tq.gguf", max_model_len=96, kv_cache_memory=4 << 20)
    plain = make_llm(tmp_path / "tq.gguf", max_model_len=96, kv_cache_memory=4 << 20, quantization="none")
    assert len(greedy(plain)[0]) == 10


@pytest.mark.parametrize("qtype", sorted(SERVED))
def test_the_kernels_give_each_row_the_same_bits_in_any_batch(qtype):
    """Why every batch goes through the kernels: a row's result is bit for bit the same whatever rows share
    its call, so a request's tokens do not depend on what it is batched with."""
    from paged_runtime.config import default_cache_dir
    from paged_runtime.kernels import cpu
    if not cpu.load(str(default_cache_dir())):
        pytest.skip("no C compiler: the CPU kernels are off")
    raw = torch.from_numpy(random_blocks(37, 512, qtype, np.random.default_rng(5)))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(6)).to(dtype)
        whole = cpu.cpu_gguf_linear(x, raw, None, SERVED[qtype].id, 512)
        for start, rows in ((0, 1), (3, 2), (7, 3), (2, 5), (11, 4)):
            part = cpu.cpu_gguf_linear(x[start:start + rows].contiguous(), raw, None, SERVED[qtype].id, 512)
            assert torch.equal(part, whole[start:start + rows]), (dtype, start, rows)


def test_a_gguf_on_the_cpu_computes_in_float32_over_a_bfloat16_cache_by_default(tmp_path, private_cache):
    """dtype auto: float32 activations; kv_cache_dtype auto then: ``GGUF_CPU_KV_CACHE`` (``utils.devices.
    resolve_precision``). An explicit dtype keeps its own cache, an explicit cache dtype is kept, and the file
    dequantized at load (``-q none``) is a plain checkpoint: its own bfloat16. On CUDA the checkpoint's dtype, as
    any model's."""
    from paged_runtime.kernels import kv_quant
    from paged_runtime.utils.devices import GGUF_CPU_KV_CACHE, Precision, resolve_precision
    path, _ = write_gguf(tmp_path, lambda name: "Q8_0")
    f32, bf16 = torch.float32, torch.bfloat16
    default_cache = kv_quant.cache_dtype(GGUF_CPU_KV_CACHE, f32)
    want = {("auto", "auto", None): (f32, default_cache), ("auto", "int8", None): (f32, torch.int8),
            ("auto", "bfloat16", None): (f32, bf16),
            ("float32", "auto", None): (f32, f32), ("bfloat16", "auto", None): (bf16, bf16),
            ("auto", "auto", "none"): (bf16, bf16)}
    for (dtype, kv_cache_dtype, quantization), (activations, cache) in want.items():
        llm = make_llm(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization, max_model_len=96,
                       kv_cache_memory=4 << 20)
        core = llm.engine.core
        got = core.dtype, core.executor.worker.model.layers[0].self_attn.attn.kv_cache.dtype
        core.shutdown()
        assert got == (activations, cache), (dtype, kv_cache_dtype, quantization)
    assert resolve_precision("auto", "auto", "bfloat16", torch.device("cuda"), True) == Precision(bf16, "auto")


def test_a_gguf_stack_runs_decode_batches_past_max_rows_in_one_call(tmp_path, private_cache, monkeypatch):
    """Every matrix GGUF blocks: a decode step of more rows than one weight pass takes (MAX_ROWS) still runs as one
    call, its products in passes of MAX_ROWS rows, and gives the tokens the op-by-op path gives (the same kernel
    in the same passes)."""
    from tests.conftest import count_decode_steps
    from paged_runtime.kernels import cpu
    path, _ = write_gguf(tmp_path, lambda name: "Q4_1")
    rows = cpu.max_rows() + 13
    prompts = [np.random.default_rng(i).integers(3, 340, 3 + i % 5).tolist() for i in range(rows)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens, fused = [], []
    for past_max_rows in (True, False):
        llm = make_llm(path, max_model_len=96, kv_cache_memory=4 << 20, max_num_seqs=rows, max_num_batched_tokens=512)
        stack = llm.engine.core.runner.cpu_plans[llm.engine.core.runner.model].stack
        assert stack.max_rows is None
        if not past_max_rows:
            monkeypatch.setattr(stack, "max_rows", cpu.max_rows())  # a plain-weight stack's limit: op by op
        calls = count_decode_steps(monkeypatch)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
        fused.append(max((n for _, n in calls), default=0))
        llm.engine.core.shutdown()
    assert fused == [rows, 0]  # every row decoded at once: in one call, then op by op
    assert tokens[0] == tokens[1]
