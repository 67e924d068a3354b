"""Where each rank sits: pipeline stages cut the layers evenly and in order, ranks map to (pp, tp) and the
driver rank is tensor rank 0 of the last stage; the model builds only its stage's modules."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paged_runtime.layers.pipeline import MissingLayer, PipelineStage
from paged_runtime.models.config import ModelConfig
from paged_runtime.models.llama import LlamaForCausalLM
from paged_runtime.worker.worker import Placement, driver_rank


@pytest.mark.parametrize("num_layers, size, ranges", [
    (2, 2, [range(0, 1), range(1, 2)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
    (30, 4, [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]),
])
def test_stages_cut_the_layers_into_contiguous_near_equal_runs(num_layers, size, ranges):
    assert [PipelineStage(rank, size).layer_range(num_layers) for rank in range(size)] == ranges


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="3 layers cannot be split into 4 pipeline stages"):
        PipelineStage(0, 4).layer_range(3)


def test_ranks_map_to_stage_and_tensor_rank_and_one_driver_samples():
    placements = [Placement(rank, tp_size=2, pp_size=3) for rank in range(6)]
    assert [(p.pp_rank, p.tp_rank) for p in placements] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [p.rank for p in placements if p.is_driver] == [driver_rank(2, 3)] == [4]


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_builds_only_its_modules(tiny_llama_dir, tied):
    config = dataclasses.replace(ModelConfig.from_folder(tiny_llama_dir), tie_word_embeddings=tied)
    first = LlamaForCausalLM(config, 64, torch.float32, torch.device("cpu"), stage=PipelineStage(0, 2, None, 1))
    last = LlamaForCausalLM(config, 64, torch.float32, torch.device("cpu"), stage=PipelineStage(1, 2, 0, None))
    assert [type(layer) is MissingLayer for layer in first.layers] == [False, True]
    assert [type(layer) is MissingLayer for layer in last.layers] == [True, False]
    assert first.embed_tokens is not None and first.norm is None and first.lm_head is None
    assert last.norm is not None and last.lm_head is not None
    assert (last.embed_tokens is not None) == tied  # a tied head's matrix is the embedding's
    assert {n.split(".")[0] for n in first.expected_weights()} == {"embed_tokens", "layers"}
    assert not any(n.startswith("layers.0.") for n in last.expected_weights())
