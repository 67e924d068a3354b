"""TritonOps' fused layer kernels against TorchOps (the oracle), and the whole Triton path end to end.

fp32 agrees to rounding of the fp32 math (the kernels round where TorchOps rounds); fp16 to one or two
units in the last place. Without a GPU the kernels run in Triton's interpreter (see conftest).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from paged_runtime.layers.ops import TorchOps, TritonOps

pytestmark = [pytest.mark.kernels]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = (torch.float32, torch.float16)


def randn(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", (False, True))
def test_rms_norm_matches_torch(dtype, with_residual):
    x, weight = randn(7, 96, dtype=dtype, seed=1), randn(96, dtype=dtype, seed=2)
    residual = randn(7, 96, dtype=dtype, seed=3) if with_residual else None
    kept = None if residual is None else residual.clone()
    got, got_residual = TritonOps.rms_norm(x, weight, 1e-5, residual)
    want, want_residual = TorchOps.rms_norm(x, weight, 1e-5, kept)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one rounded add on both sides
    if residual is not None:
        assert torch.equal(residual, kept)  # inputs are not written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_in_place_as_torch(dtype):
    head_dim, sizes = 64, (4 * 64, 2 * 64, 2 * 64)
    qkv = randn(5, sum(sizes), dtype=dtype, seed=4)
    angles = torch.outer(torch.arange(40.), torch.rand(head_dim // 2, generator=torch.Generator().manual_seed(5)))
    emb = torch.cat((angles, angles), dim=-1).to(DEVICE)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.tensor([0, 7, 39, 3, 3], device=DEVICE)
    want = TorchOps.rope(qkv.clone(), sizes, head_dim, TorchOps.rope_inputs(cos, sin, positions, dtype))
    got = TritonOps.rope(qkv, sizes, head_dim, TritonOps.rope_inputs(cos, sin, positions, dtype))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])
    assert got[0].data_ptr() == qkv.data_ptr()  # rotated in place: q is a view of the fused rows


def test_partial_rotary_falls_back_to_torch():
    head_dim, sizes = 32, (2 * 32, 32, 32)
    qkv = randn(3, sum(sizes), seed=6)
    emb = torch.outer(torch.arange(8.), torch.linspace(0.1, 1, 8)).to(DEVICE)
    cos, sin = torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()  # 16 of 32 dims rotate
    positions = torch.tensor([1, 5, 2], device=DEVICE)
    want = TorchOps.rope(qkv, sizes, head_dim, TorchOps.rope_inputs(cos, sin, positions, qkv.dtype))
    got = TritonOps.rope(qkv, sizes, head_dim, TritonOps.rope_inputs(cos, sin, positions, qkv.dtype))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", (160, 1500))  # one block; two blocks with a ragged tail (not a power of two)
def test_silu_mul_matches_torch(dtype, inter):
    gate_up = randn(3, 2 * inter, dtype=dtype, seed=7)
    torch.testing.assert_close(TritonOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up), **TOL[dtype])


def test_empty_batch():
    x = randn(0, 32)
    assert TritonOps.rms_norm(x, randn(32), 1e-6, x.clone())[0].shape == (0, 32)
    assert TritonOps.silu_mul(randn(0, 64)).shape == (0, 32)


def test_triton_path_greedy_matches_transformers(tiny_llama_dir):
    """The model on TritonOps and the triton attention backend: transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import hf_greedy, make_llm
    from paged_runtime import SamplingParams
    prompt = [5, 900, 31, 4000, 77, 12]
    llm = make_llm(tiny_llama_dir, attention_backend="triton", max_model_len=64, max_num_seqs=2,
                   kv_cache_memory=2**18)
    assert isinstance(llm.engine.core.ops, TritonOps)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    assert list(got) == hf_greedy(hf, prompt, 4)


class OpLog(TorchDispatchMode):
    """The ops dispatched while ``on``, one list per call of the hooked module."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.calls = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.calls[-1].append(func._schema.name)
        return func(*args, **(kwargs or {}))


# Ops that launch no kernel (views and allocations).
NO_LAUNCH = {"aten::view", "aten::split_with_sizes", "aten::flatten", "aten::empty_like", "aten::empty",
             "aten::new_empty", "aten::slice", "aten::unsqueeze", "aten::t", "aten::detach"}


def test_decode_layer_launches_ten_kernels(tiny_llama_dir):
    """A decoder layer in a one-row decode step: two add+norms, RoPE, SiLU-and-mul, four GEMMs, store, attention."""
    from tests.conftest import make_llm
    from paged_runtime import SamplingParams
    llm = make_llm(tiny_llama_dir, attention_backend="triton", max_model_len=64, max_num_seqs=2,
                   kv_cache_memory=2**18)
    llm.engine.core.runner.graphs = None  # a step replayed from a CUDA graph runs no hooks: decode eagerly, as here
    log = OpLog()

    def start(module, args):
        log.on = args[0].shape[0] == 1
        log.calls.append([])

    layer = llm.engine.core.runner.model.layers[1]
    layer.register_forward_pre_hook(start)
    layer.register_forward_hook(lambda *_: setattr(log, "on", False))
    with log:
        llm.generate([{"prompt_token_ids": [5, 900, 31]}], SamplingParams(max_tokens=2, temperature=0,
                     ignore_eos=True), use_tqdm=False)
    decode = [op for op in log.calls[-1] if op not in NO_LAUNCH]
    assert decode == ["paged_runtime::triton_add_rms_norm", "aten::linear", "paged_runtime::triton_rope_",
                      "paged_runtime::triton_store_kv", "paged_runtime::triton_paged_attention", "aten::linear",
                      "paged_runtime::triton_add_rms_norm", "aten::linear", "paged_runtime::triton_silu_mul",
                      "aten::linear"]


def test_the_triton_backend_brings_the_fused_ops_and_enforce_eager_plain_pytorch(tiny_llama_dir):
    from tests.conftest import make_llm
    common = dict(max_model_len=128, kv_cache_memory=2**20)
    assert make_llm(tiny_llama_dir, attention_backend="triton", **common).engine.core.ops.name == "triton"
    eager = make_llm(tiny_llama_dir, attention_backend="triton", enforce_eager=True, **common)
    assert eager.engine.core.ops.name == "torch"
    if torch.cuda.is_available():  # the automatic choice on CUDA
        assert make_llm(tiny_llama_dir, device="cuda", **common).engine.core.ops.name == "triton"


def test_rms_norm_of_strided_rows():
    """OLMoE norms q and k as column slices of the fused qkv rows."""
    qkv, weight = randn(3, 96, seed=8), randn(32, seed=9)
    torch.testing.assert_close(TritonOps.rms_norm(qkv[:, 32:64], weight, 1e-6)[0],
                               TorchOps.rms_norm(qkv[:, 32:64].contiguous(), weight, 1e-6)[0], **TOL[torch.float32])
