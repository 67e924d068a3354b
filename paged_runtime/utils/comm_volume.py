"""Bytes a tensor-/pipeline-parallel step hands to torch.distributed, from the model's shape (no measuring).

For one step of ``num_tokens`` scheduled tokens of which ``num_sampled`` rows go through the LM head (the
last row of every item that samples; no speculative drafts, no prompt logprobs), a Llama-like model of
``num_layers`` decoder layers, hidden size H, vocabulary V and ``dtype_bytes`` per element, rank
(pipeline stage s, any tensor-parallel rank) of ``tp`` x ``pp`` calls:

* ``all_reduce`` (only when tp > 1): two per decoder layer of its stage (attention's o_proj and the MLP's
  down_proj are row-parallel), plus one for the embedding on stage 0; each of ``num_tokens x H`` elements;
* ``all_gather`` (only when tp > 1, last stage): the LM head's logits, ``num_sampled x ceil(V / tp)``
  elements from each rank (the vocabulary shard is padded);
* ``send`` (stages before the last) / ``recv`` (stages after the first): ``(x, residual)`` in one buffer,
  ``2 x num_tokens x H`` elements.

"Bytes" are the tensor each rank hands to the call (the payload), not what the algorithm puts on the
wire: a ring all-reduce sends about 2 (tp - 1) / tp of it per rank, an all-gather tp - 1 shards.
``tests/unit/test_comm_volume.py`` checks these formulas against the collectives a real step calls;
``benchmarks/parallel.py`` reports them per step.
"""
from __future__ import annotations

KINDS = ("all_reduce", "all_gather", "send", "recv")


def stage_layers(num_layers: int, pp: int, stage: int) -> int:
    """How many decoder layers stage ``stage`` of ``pp`` holds (earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    return base + (stage < extra)


def rank_bytes(model, tp: int, pp: int, stage: int, num_tokens: int, num_sampled: int,
               dtype_bytes: int) -> dict[str, int]:
    """Payload bytes one tensor-parallel rank of pipeline stage ``stage`` hands to each kind of call in one
    step (``model``: anything with ``num_layers``, ``hidden_size`` and ``vocab_size``)."""
    hidden_row = model.hidden_size * dtype_bytes
    out = dict.fromkeys(KINDS, 0)
    if tp > 1:
        reduces = 2 * stage_layers(model.num_layers, pp, stage) + (stage == 0)
        out["all_reduce"] = reduces * num_tokens * hidden_row
        if stage == pp - 1:
            out["all_gather"] = num_sampled * -(-model.vocab_size // tp) * dtype_bytes
    if stage < pp - 1:
        out["send"] = 2 * num_tokens * hidden_row
    if stage > 0:
        out["recv"] = 2 * num_tokens * hidden_row
    return out


def step_bytes(model, tp: int, pp: int, num_tokens: int, num_sampled: int, dtype_bytes: int) -> dict[str, int]:
    """Payload bytes all ``tp x pp`` ranks together hand to each kind of call in one step (a send and its
    receive are the same bytes: count ``send`` for the pipeline's traffic)."""
    total = dict.fromkeys(KINDS, 0)
    for stage in range(pp):
        for kind, n in rank_bytes(model, tp, pp, stage, num_tokens, num_sampled, dtype_bytes).items():
            total[kind] += tp * n
    return total


def rank_calls(model, tp: int, pp: int, stage: int, samples: bool) -> dict[str, int]:
    """How many calls of each kind that rank makes in one step (``samples``: some row reaches the LM head;
    a step of prompt chunks that all stop short of their prompt's end gathers no logits)."""
    out = dict.fromkeys(KINDS, 0)
    if tp > 1:
        out["all_reduce"] = 2 * stage_layers(model.num_layers, pp, stage) + (stage == 0)
        out["all_gather"] = int(stage == pp - 1 and samples)
    out["send"], out["recv"] = int(stage < pp - 1), int(stage > 0)
    return out
