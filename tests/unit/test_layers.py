"""layers/: each tensor-parallel shard spec loads its share of a full checkpoint tensor, and the ranks'
outputs put together (concatenated or summed, as the all-reduce / all-gather would) equal the
unsharded layer's; the import layering the package map promises holds."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from paged_runtime.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                         TensorParallel, UnquantizedLinearMethod)
from paged_runtime.layers.ops import TorchOps
from paged_runtime.layers.vocab import ParallelLMHead, VocabParallelEmbedding

CPU, F32 = torch.device("cpu"), torch.float32
METHOD = UnquantizedLinearMethod(TorchOps())


@dataclass(frozen=True)
class LocalRanks(TensorParallel):
    """A rank whose collectives are left to the test: it returns its partial result as it is."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def ranks(size: int) -> list[TensorParallel]:
    return [LocalRanks(rank, size) for rank in range(size)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_merged_gate_up_shards_concatenate_to_the_full_product():
    gate, up, x = randn(12, 8, seed=1), randn(12, 8, seed=2), randn(3, 8, seed=3)
    full = torch.cat([x @ gate.T, x @ up.T], dim=-1)
    parts = []
    for tp in ranks(2):
        layer = MergedColumnParallelLinear(8, [12, 12], False, METHOD, F32, CPU, tp)
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        assert layer.weight.shape == (12, 8)
        parts.append(layer(x).split(6, dim=-1))  # this rank's gate half, then its up half
    assert torch.allclose(torch.cat([p[0] for p in parts] + [p[1] for p in parts], dim=-1), full, atol=1e-5)


@pytest.mark.parametrize("tp_size, num_kv_heads", [(2, 2), (4, 2)], ids=["kv-split", "kv-replicated"])
def test_qkv_shards_hold_their_heads_and_replicate_kv_heads_when_ranks_outnumber_them(tp_size, num_kv_heads):
    heads, dim, hidden = 4, 2, 8
    q, k, v = randn(heads * dim, hidden, seed=4), randn(num_kv_heads * dim, hidden, seed=5), randn(
        num_kv_heads * dim, hidden, seed=6)
    for tp in ranks(tp_size):
        layer = QKVParallelLinear(hidden, dim, heads, num_kv_heads, False, METHOD, F32, CPU, tp)
        for shard, tensor in zip("qkv", (q, k, v)):
            layer.weight_loader(layer.weight, tensor, shard)
        per_rank = heads // tp_size
        kv_head = tp.rank * num_kv_heads // tp_size  # the KV head this rank's query heads read
        want_q = q[tp.rank * per_rank * dim:(tp.rank + 1) * per_rank * dim]
        want_k, want_v = (t[kv_head * dim:(kv_head + 1) * dim] for t in (k, v))
        assert layer.num_kv_heads == 1
        assert torch.equal(layer.weight, torch.cat([want_q, want_k, want_v]))


def test_row_parallel_partial_products_sum_to_the_full_product_with_the_bias_once():
    weight, bias, x = randn(6, 8, seed=7), randn(6, seed=8), randn(3, 8, seed=9)
    total = torch.zeros(3, 6)
    for tp in ranks(2):
        layer = RowParallelLinear(8, 6, True, METHOD, F32, CPU, tp)
        layer.weight_loader(layer.weight, weight)
        layer.weight_loader(layer.bias, bias)
        total += layer(x[:, tp.rank * 4:(tp.rank + 1) * 4]) - bias  # each rank's forward adds the bias once
    assert torch.allclose(total + bias, x @ weight.T + bias, atol=1e-5)


def test_vocab_shards_embed_and_score_as_the_whole_table():
    table, ids, hidden = randn(11, 4, seed=10), torch.tensor([0, 5, 6, 10]), randn(2, 4, seed=11)
    embedded, logits = torch.zeros(4, 4), []
    for tp in ranks(2):  # 11 rows over 2 ranks: 6 each, the last one padded
        embedding = VocabParallelEmbedding(11, 4, F32, CPU, tp)
        embedding.weight_loader(embedding.weight, table)
        embedded += embedding(ids)
        head = ParallelLMHead(11, 4, METHOD, F32, CPU, tp)
        head.weight_loader(head.weight, table)
        logits.append(METHOD.apply(head, hidden, None))
    assert torch.equal(embedded, table[ids])
    assert torch.allclose(torch.cat(logits, dim=-1)[:, :11], hidden @ table.T, atol=1e-5)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused():
    layer = RowParallelLinear(8, 6, False, METHOD, F32, CPU)
    with pytest.raises(ValueError, match=r"shape \(6, 7\), expected 8 along dimension 1"):
        layer.weight_loader(layer.weight, randn(6, 7))
    qkv = QKVParallelLinear(8, 2, 4, 2, False, METHOD, F32, CPU)
    with pytest.raises(ValueError, match=r"shape \(6, 8\), expected 4 along dimension 0"):
        qkv.weight_loader(qkv.weight, randn(6, 8), "k")  # too many rows: never silently cut


# ---- import layering -------------------------------------------------------------------------------
PACKAGE = Path(__file__).resolve().parents[2] / "paged_runtime"
# package -> packages of paged_runtime it must never import (directly or inside a function)
FORBIDDEN = {
    "core": ("models", "kernels", "layers", "worker", "attention", "engine", "entrypoints",
             "spec_decode.draft_model", "spec_decode.rejection_sampler"),
    "kernels": ("models", "layers", "worker", "engine", "core", "attention", "entrypoints"),
    "layers": ("models", "worker", "engine", "core", "entrypoints", "attention"),
    "attention": ("models", "layers", "worker", "engine", "core", "entrypoints"),
    "sample": ("models", "worker", "engine", "core", "entrypoints"),
    "spec_decode": ("core", "engine", "worker", "entrypoints"),
    "models": ("worker", "engine", "core", "entrypoints", "attention"),
    "worker": ("engine", "entrypoints", "executor"),
    "executor": ("engine", "entrypoints", "core"),
    "structured_output": ("models", "worker", "engine", "core", "entrypoints", "attention", "layers", "kernels",
                          "sample"),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_import_runs_back_up_the_layers():
    offences = []
    for package, banned in FORBIDDEN.items():
        for path in (PACKAGE / package).rglob("*.py"):
            for name in imported_modules(path):
                if any(name == f"paged_runtime.{b}" or name.startswith(f"paged_runtime.{b}.") for b in banned):
                    offences.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert offences == []


def test_the_layering_check_catches_an_offence(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from paged_runtime.core.scheduler import Scheduler\n")
    assert "paged_runtime.core.scheduler" in imported_modules(bad)
