"""Sliding window and soft cap in the CPU decode kernel and the Triton kernel, against the torch backend.

One step's batch holds every kind of item (decodes, verification rows, a whole prompt, chunks after a
cached prefix), with contexts that start, end and cross blocks, GQA, and windows smaller than some
contexts and larger than others. The kernels must not read before a query's window: every slot before
the earliest window start of its item is NaN in their cache (finite in the oracle's), so a read shows
(for the CPU backend, in its kernel's rows: its prompt chunks gather as the torch backend does).
Triton runs in its interpreter without a GPU (see conftest); sizes are small.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_runtime.attention import cpu_backend, torch_backend, triton_backend
from paged_runtime.batch import BatchItem, build_batch, layout_order
from paged_runtime.config import default_cache_dir
from paged_runtime.kernels import cpu

from .conftest import DEVICE

pytestmark = [pytest.mark.kernels]

# (start, query tokens, drafts among them): decodes, verifications, a whole prompt, chunks after a prefix.
ITEMS = [(0, 1, 0), (4, 1, 0), (39, 1, 0), (70, 1, 0), (100, 1, 0), (50, 4, 3), (9, 3, 2),
         (0, 45, 0), (33, 20, 0), (64, 7, 0)]
WINDOWS = [None, 1, 20, 33, 500]


def make_step(block_size: int, heads: int, kv_heads: int, dim: int, seed: int = 0, step_items=ITEMS):
    g = torch.Generator().manual_seed(seed)
    items = [BatchItem(start, [1] * n, spec, row) for row, (start, n, spec) in enumerate(step_items)]
    items = [items[i] for i in layout_order(items)]
    per_item = [-(-(s.start + len(s.token_ids)) // block_size) for s in items]
    num_blocks = sum(per_item) + 2
    order = torch.randperm(num_blocks, generator=g).numpy()
    tables = np.zeros((len(step_items), max(per_item)), np.int32)
    used = 0
    for s, n in zip(items, per_item):
        tables[s.table_row, :n] = order[used:used + n]
        used += n
    batch = build_batch(items, tables, block_size)
    cache = torch.randn(num_blocks * block_size, 2, kv_heads, dim, generator=g)
    q = torch.randn(batch.num_tokens, heads, dim, generator=g)
    k, v = (torch.randn(batch.num_tokens, kv_heads, dim, generator=g) for _ in range(2))
    return batch, cache, q, k, v


def poison_before_windows(batch, cache: torch.Tensor, window: int | None, num_items: int) -> torch.Tensor:
    """A copy of ``cache`` with NaN in every slot before the earliest window start of each of the first
    ``num_items`` items."""
    cache = cache.clone()
    if window is None:
        return cache
    for i in range(num_items):
        first = int(batch.starts[i]) - window + 1
        if first > 0:
            cache[torch.from_numpy(batch.slots(slice(i, i + 1), np.arange(first))[0])] = float("nan")
    return cache


def attend(build, batch, cache, q, k, v, window, softcap):
    meta = build(batch, DEVICE)
    cache = cache.to(DEVICE)
    return meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache, q.shape[-1] ** -0.5, window, softcap).cpu()


BACKENDS = {"triton": triton_backend.build_metadata}
if DEVICE.type == "cpu" and cpu.load(default_cache_dir()):
    BACKENDS["cpu"] = cpu_backend.build_metadata


SHAPES = {"bs16-gqa2-d64": (16, 4, 2, 64), "bs32-gqa3-d32": (32, 3, 1, 32)}
# Every window, cap and shape on the CPU kernel; fewer on Triton, whose interpreter is slow.
CASES = [(backend, window, softcap, shape) for backend in sorted(BACKENDS) for shape in SHAPES
         for window in (WINDOWS if backend == "cpu" or shape == "bs16-gqa2-d64" else [7, 33])
         for softcap in ((None, 3.0) if backend == "cpu" or window in (None, 20) else (None,))]


@pytest.mark.parametrize("backend,window,softcap,shape", CASES, ids=lambda v: str(v))
def test_matches_torch_backend(backend, window, softcap, shape):
    shape = SHAPES[shape]
    batch, cache, q, k, v = make_step(*shape)
    ref = attend(torch_backend.build_metadata, batch, cache, q, k, v, window, softcap)
    out = attend(BACKENDS[backend], batch, poison_before_windows(batch, cache, window, batch.num_items), q, k, v,
                 window, softcap)
    assert torch.isfinite(out).all(), "a kernel read a slot before a query's window"
    error = ((out - ref).abs().max() / ref.abs().max()).item()
    assert error <= 1e-4, f"max relative error {error:.2e}"


# Past 512 keys of context and 128 x 128 queries x keys, a prompt chunk is the flash kernel's: a whole prompt of
# 600 and 200 queries after 400 cached tokens; the 7 queries after 600 and the 20 after 20 stay kernel rows.
LONG_ITEMS = [(0, 1, 0), (300, 1, 0), (20, 20, 0), (400, 200, 0), (0, 600, 0), (600, 7, 0)]


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU kernels are off here")
@pytest.mark.parametrize("window,softcap", [(None, None), (100, 3.0)], ids=["plain", "window-softcap"])
def test_cpu_backend_sends_long_chunks_to_the_flash_kernel(window, softcap):
    batch, cache, q, k, v = make_step(16, 4, 2, 64, step_items=LONG_ITEMS)
    meta = cpu_backend.build_metadata(batch, DEVICE)
    flash = sorted(group.num_rows for group in meta.decodes if isinstance(group, cpu_backend.PromptChunk))
    rows = sum(group.num_rows for group in meta.decodes if isinstance(group, cpu_backend.DecodeRows))
    assert flash == [200, 600] and rows == 2 + 20 + 7
    assert meta.prefills == [] and not meta.rows_only
    ref = attend(torch_backend.build_metadata, batch, cache, q, k, v, window, softcap)
    out = attend(cpu_backend.build_metadata, batch, poison_before_windows(batch, cache, window, batch.num_items),
                 q, k, v, window, softcap)
    assert torch.isfinite(out).all() and ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_window_and_cap_change_the_result():
    """The oracle comparisons above can fail: a window shorter than the context and a cap both matter."""
    batch, cache, q, k, v = make_step(16, 4, 2, 64)
    full = attend(torch_backend.build_metadata, batch, cache, q * 4, k, v, None, None)
    assert not torch.allclose(full, attend(torch_backend.build_metadata, batch, cache, q * 4, k, v, 20, None))
    assert not torch.allclose(full, attend(torch_backend.build_metadata, batch, cache, q * 4, k, v, None, 3.0))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU kernels are off here")
@pytest.mark.parametrize("window", [1, 24, 100], ids=lambda w: f"window-{w}")
def test_fused_decode_layer_slides(window):
    """The compiled decode step (``DecodeStack``) with a window = the layer on PyTorch ops with the torch backend."""
    from paged_runtime.layers.linear import UnquantizedLinearMethod
    from paged_runtime.kernels.cpu import DecodeStack
    from paged_runtime.layers.ops import TorchOps
    from paged_runtime.layers.rotary import RotaryEmbedding
    from paged_runtime.models.config import ModelConfig
    from paged_runtime.models.llama import LlamaDecoderLayer
    config = ModelConfig.from_dict({
        "architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 96, "intermediate_size": 160,
        "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": window})
    assert config.window(0) == window
    ops, device = TorchOps(), torch.device("cpu")
    rope = RotaryEmbedding(16, 512, config.rope_theta, None, ops, device)
    layer = LlamaDecoderLayer(config, rope, ops, UnquantizedLinearMethod(ops), torch.float32, device)
    g = torch.Generator().manual_seed(window)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    items = [BatchItem(n - 1, [1], 0, row) for row, n in enumerate([1, 17, 40, 90, 150])]
    tables = torch.randperm(64, generator=g)[:50].view(5, 10).numpy().astype(np.int32)
    batch = build_batch(items, tables, 16)
    kv_cache = torch.randn(64 * 16, 2, 2, 16, generator=g)
    x, residual = (torch.randn(5, 96, generator=g) for _ in range(2))
    positions = torch.from_numpy(batch.positions)
    layer.self_attn.attn.kv_cache = ref_cache = kv_cache.clone()
    ref_x, ref_residual = layer(x, residual.clone(), rope.inputs(positions, torch.float32),
                                torch_backend.build_metadata(batch, device))
    meta = cpu_backend.build_metadata(batch, device)
    layer.self_attn.attn.kv_cache = kv_cache
    DecodeStack([layer.describe()], torch.float32).run(x, residual, positions, meta.slot_mapping,
                                                       meta.decode_rows.block_tables, meta.decode_rows.context_lens, 16)
    assert torch.allclose(kv_cache, ref_cache, atol=1e-5)
    assert torch.allclose(residual, ref_residual, atol=1e-5)
    assert torch.allclose(x, ref_x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 20], ids=lambda w: f"window-{w}")
def test_triton_split_kv_decodes_slide(window):
    """Decode-only steps may split each context into segments: a window shortens what they share out."""
    batch, cache, q, k, v = make_step(16, 4, 2, 64)
    rows = batch.num_decodes
    decodes = build_batch([BatchItem(int(s), [1], 0, i) for i, s in enumerate(batch.starts[:rows])],
                          batch.block_tables, 16)
    q, k, v = q[:rows], k[:rows], v[:rows]
    ref = attend(torch_backend.build_metadata, decodes, cache, q, k, v, window, 2.0)

    def split(batch, device):
        meta = triton_backend.build_metadata(batch, device)
        meta.num_kv_splits = 3
        return meta
    out = attend(split, decodes, poison_before_windows(decodes, cache, window, rows), q, k, v, window, 2.0)
    assert torch.isfinite(out).all()
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_triton_backend_serves_a_sliding_window_model(tiny_llama_dir, tmp_path):
    """The runtime on a windowed model (the tiny Llama's weights as a Mistral with a 24-token window): greedy
    outputs identical to the torch backend's, which tests/e2e/test_sliding_window.py holds to transformers;
    chunked prefill, a shared prefix and decodes, all past the window (kept small: the interpreter is slow)."""
    import json
    import random
    import shutil

    from tests.conftest import assert_idle, make_llm
    from paged_runtime import SamplingParams
    folder = tmp_path / "tiny-windowed"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=24)
    (folder / "config.json").write_text(json.dumps(config))
    rng = random.Random(3)
    system = [rng.randrange(3, 49152) for _ in range(40)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(3, 49152) for _ in range(n)]} for n in (1, 20)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(folder, attention_backend=backend, max_model_len=256, max_num_batched_tokens=32,
                       max_num_seqs=4, kv_cache_memory=2**20)
        assert llm.engine.core.kv_cache.sliding_window == 24
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_idle(llm)
    assert outs["triton"] == outs["torch"]
