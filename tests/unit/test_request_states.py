"""The runner's own request state: kept up to date from what the scheduler sends, rows reused, tables
rewritten from the changed index, and batches built from it laid out as every backend expects."""
from __future__ import annotations

import numpy as np
import torch

from paged_runtime.batch import BatchItem, build_batch, layout_order
from paged_runtime.core.scheduler_output import NewRequestData
from paged_runtime.sampling_params import SamplingParams
from paged_runtime.worker.request_states import RequestStates


def new_request(request_id: str, tokens: list[int], **params) -> NewRequestData:
    return NewRequestData(request_id, tokens, len(tokens), SamplingParams(**params), 0, frozenset({2}))


def test_rows_are_reused_and_sampling_parameters_live_in_them():
    states = RequestStates(8, 100, torch.device("cpu"))
    a = states.add(new_request("a", [5, 6], temperature=0.5, top_k=7))
    b = states.add(new_request("b", [5], top_p=0.9))
    assert (a.row, b.row) == (0, 1)
    assert states.temperature[a.row] == 0.5 and states.top_k[a.row] == 7 and states.top_k[b.row] == 100
    states.remove("a")
    c = states.add(new_request("c", [1], min_p=0.25))
    assert c.row == 0 and states.min_p[0] == 0.25 and states.top_k[0] == 100  # nothing left of a
    for i in range(20):  # past the first 16 rows: the arrays grow, rows stay unique
        states.add(new_request(f"x{i}", [1]))
    assert len({s.row for s in states.requests.values()}) == 22


def test_block_table_is_rewritten_from_the_first_changed_block():
    states = RequestStates(8, 100, torch.device("cpu"))
    a = states.add(new_request("a", [5, 6]))
    states.update_blocks(a, 0, [4, 9, 3])
    states.update_blocks(a, 2, [7])  # copy-on-write replaced the tail block
    assert states.block_ids(a).tolist() == [4, 9, 7]
    states.update_blocks(a, 0, [1])  # re-admitted after a preemption: a new, shorter table
    assert states.block_ids(a).tolist() == [1] and states.block_tables[a.row].tolist() == [1] + [0] * 7


def test_token_history_takes_the_schedulers_tokens_and_appends_its_own_samples():
    states = RequestStates(8, 100, torch.device("cpu"))
    a = states.add(new_request("a", [5, 6, 7]))
    a.write_tokens(3, [11, 12, 13])  # sampled: a token and two accepted drafts (a verification step)
    a.write_tokens(5, [40])  # the scheduler's input for the next step says position 5 is 40 (a beam's choice)
    assert a.token_ids == [5, 6, 7, 11, 12, 40] and a.num_output_tokens == 3


def test_the_batch_lays_out_decodes_verifications_then_chunks_with_their_slots():
    tables = np.array([[3, 1, 0], [2, 0, 0], [5, 4, 6]], np.int32)
    items = [BatchItem(0, [10, 11, 12], 0, 0),  # a prompt chunk
             BatchItem(17, [20], 0, 1),  # a decode at position 17 (block 2 of row 1: id 0)
             BatchItem(4, [30, 31], 1, 2)]  # a verification: last token + one draft
    order = layout_order(items)
    assert order == [1, 2, 0]
    batch = build_batch([items[i] for i in order], tables, 8)
    assert (batch.num_decodes, batch.num_verifies) == (1, 1)
    assert batch.token_ids.tolist() == [20, 30, 31, 10, 11, 12]
    assert batch.positions.tolist() == [17, 4, 5, 0, 1, 2]
    assert batch.query_start_loc.tolist() == [0, 1, 3, 6] and batch.seq_lens.tolist() == [18, 6, 3]
    # position p of a table lives in slot table[p // 8] * 8 + p % 8
    assert batch.slot_mapping.tolist() == [0 * 8 + 1, 5 * 8 + 4, 5 * 8 + 5, 3 * 8 + 0, 3 * 8 + 1, 3 * 8 + 2]
    assert batch.block_tables.tolist() == [[2, 0, 0], [5, 4, 6], [3, 1, 0]]  # in batch order


def test_a_request_that_cannot_be_set_up_takes_no_row_and_retain_drops_the_rest():
    """After a failed step the runner keeps only live requests, and its rows still add up."""
    import pytest
    states = RequestStates(8, 100, torch.device("cpu"))
    states.add(new_request("a", [5]))
    with pytest.raises(OverflowError):  # top_k beyond int64 (the HTTP edge refuses it too, later)
        states.add(new_request("huge", [5], top_k=2**70))
    sibling = NewRequestData("seed", [5], 1, SamplingParams(n=2, seed=2**64 - 1), 1, frozenset({2}))
    assert states.add(sibling).row == 1  # a sibling's seed wraps past 2**64 (sequence_seed): it sets up fine
    assert states.retain({"a"}) == ["seed"]
    assert set(states.requests) == {"a"}
    states.check_invariants()
    assert states.add(new_request("b", [6])).row == 1  # no row was lost
    assert states.retain({"b"}) == ["a"]
    states.check_invariants()
    assert set(states.requests) == {"b"} and states.add(new_request("c", [7])).row == 0


class DeviceGenerator:
    """A CUDA generator as torch 2.11 made them: no weak references (what the sampler's table of host twins,
    keyed weakly by device generator, died of on an H100)."""
    __slots__ = ("device", "seed")

    def __init__(self, device) -> None:
        self.device, self.seed = torch.device(device), None

    def manual_seed(self, seed: int) -> "DeviceGenerator":
        self.seed = seed
        return self

    def initial_seed(self) -> int:
        return self.seed


def test_a_seeded_request_on_a_gpu_draws_its_seeds_from_a_host_generator_seeded_alike(monkeypatch):
    """The device generator serves the speculative paths; the sampler's per-step seed comes from a CPU
    generator made with the same seed when the request arrives (no device read, no table of twins)."""
    from paged_runtime.sampling_params import sequence_seed
    real = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device="cpu": real() if torch.device(device).type == "cpu"
                        else DeviceGenerator(device))
    states = RequestStates(8, 100, torch.device("cuda"))
    sibling = states.add(NewRequestData("s", [5], 1, SamplingParams(n=2, seed=7, temperature=1.0), 1, frozenset()))
    assert isinstance(sibling.generator, DeviceGenerator) and sibling.generator.seed == sequence_seed(7, 1)
    host = sibling.host_generator
    assert host.device.type == "cpu" and host.initial_seed() == sequence_seed(7, 1)
    greedy = states.add(new_request("g", [5], seed=7, temperature=0.0))
    assert greedy.generator is None and greedy.host_generator is None  # greedy rows draw nothing


def test_on_the_cpu_the_request_generator_is_its_own_host_generator():
    state = RequestStates(8, 100, torch.device("cpu")).add(new_request("a", [5], seed=3, temperature=1.0))
    assert state.host_generator is state.generator and state.generator.initial_seed() == 3
