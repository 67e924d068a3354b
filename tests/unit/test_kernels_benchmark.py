"""benchmarks/kernels.py's parts that do not need a GPU: the bytes a decode step reads (the floor's numerator),
the end-to-end measurements run through on a tiny model on the CPU (a crash there would cost a GPU run its
minutes), and the verdicts against issue 36's targets."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import kernels
from benchmarks.kernels import (DECODE_BATCH, PREFILL_TOKENS, draw_verdicts, measure_runtime, step_weight_bytes,
                                verdicts)
from benchmarks.common import write_png
from tests.conftest import make_llm, save_tiny_llama


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_a_step_reads_every_weight_but_an_untied_input_embedding(tiny_llama_dir):
    tensors = hf_tensors(tiny_llama_dir)
    want = sum(nbytes(t) for name, t in tensors.items() if name != "model.embed_tokens.weight")
    assert step_weight_bytes(make_llm(tiny_llama_dir).engine.core.runner.model) == want


def test_a_tied_head_counts_its_matrix_once(tmp_path, smollm2_dir):
    folder = save_tiny_llama(tmp_path, smollm2_dir, tie_word_embeddings=True)
    tensors = hf_tensors(folder)
    assert "lm_head.weight" not in tensors
    want = sum(nbytes(t) for t in tensors.values())  # the embedding, read as the head
    assert step_weight_bytes(make_llm(folder).engine.core.runner.model) == want


def test_int4_weights_count_their_codes_and_group_scales(tiny_llama_dir):
    """Every linear of the layers at 4 bits a weight (inputs padded to groups of 128) plus a float32 scale and
    zero per group and output; the head and norms as they are."""
    tensors = hf_tensors(tiny_llama_dir)
    want = 0
    for name, t in tensors.items():
        if name.startswith("model.layers.") and t.dim() == 2:
            n, k = t.shape
            groups = -(-k // 128)
            want += n * groups * 128 // 2 + groups * n * 2 * 4
        elif name != "model.embed_tokens.weight":
            want += nbytes(t)
    llm = make_llm(tiny_llama_dir, quantization="int4")
    assert step_weight_bytes(llm.engine.core.runner.model) == want


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_the_end_to_end_measurements_run_through(tiny_llama_dir, quantization):
    out = measure_runtime(tiny_llama_dir, quantization, max_model_len=64, decode_batch=3, prefill_tokens=40,
                          copy_bw=1e10, eager=quantization == "none", kv_cache_memory=2**24)
    keys = {"quantization", "step_weight_bytes", "floor_step_ms", "attention_backend", "batch1_step_ms",
            "batch1_step_vs_floor", "batch3_step_ms", "prefill40_ms"} | (
        {"batch1_step_ms_eager"} if quantization == "none" else set())
    assert set(out) == keys and out["quantization"] == quantization
    assert out["floor_step_ms"] == 1e3 * out["step_weight_bytes"] / 1e10
    assert out["batch1_step_vs_floor"] == out["batch1_step_ms"] / out["floor_step_ms"]
    assert all(out[k] > 0 for k in keys - {"quantization", "attention_backend"})


def test_the_random_model_is_built_and_saved_once(tmp_path, monkeypatch):
    """random_llama on the CPU with a tiny shape: a loadable folder with SmolLM2's tokenizer; a second call
    finds it."""
    monkeypatch.setitem(kernels.LLAMA_CONFIGS, "tiny", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, tie_word_embeddings=True))
    folder = kernels.random_llama("tiny", tmp_path, device="cpu")
    assert (folder / "tokenizer.json").exists() and kernels.weight_bytes(folder) > 0
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert kernels.random_llama("tiny", tmp_path, device="cpu") == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp


def test_end_to_end_saves_after_each_figure_and_reports_each(tiny_llama_dir, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(kernels, "random_llama", lambda key, cache_dir: tiny_llama_dir)
    monkeypatch.setattr(kernels, "DECODE_BATCH", 2)
    monkeypatch.setattr(kernels, "PREFILL_TOKENS", 30)
    args = kernels.parse_args(["--models", "tiny,other", "--quantized-models", "tiny", "--skip-transformers",
                               "--skip-eager", "--max-model-len", "300"])
    results, saved = {}, []
    kernels.end_to_end(args, 1e10, lambda: saved.append(
        {key: {q: len(r) for q, r in model["quantizations"].items()} for key, model in results.items()}), results)
    # each model's bf16 and (tiny only) int4 runs, each saved after its name, weights and floor, batch-1 step,
    # 2-row step and prefill
    per_run = [1, 4, 6, 7, 8]
    assert saved == ([{"tiny": {"none": n}} for n in per_run]
                     + [{"tiny": {"none": 8, "int4": n}} for n in per_run]
                     + [{"tiny": {"none": 8, "int4": 8}, "other": {"none": n}} for n in per_run])
    assert results["tiny"]["checkpoint_bytes"] == kernels.weight_bytes(tiny_llama_dir)
    record = {"end_to_end": results}
    kernels.report(record, [], 1e10, "test card", tmp_path / "kernels.json")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines if line.startswith(("tiny ", "other "))] == [
        ["tiny", "none"], ["tiny", "int4"], ["other", "none"]]
    written = json.loads((tmp_path / "kernels.json").read_text())
    assert set(written["verdicts"]) == {"tiny_w4a16_batch1_step_vs_floor", "tiny_w4a16_batch1_speedup",
                                        "tiny_w4a16_batch2_step_ms_vs_bf16", "tiny_w4a16_prefill30_ms_vs_bf16"}


def test_a_run_stopped_midway_reports_what_it_measured(capsys, tmp_path):
    """Stopped after int4's batch-1 step: its floor ratio and speedup are judged, the figures it lacks are not."""
    e2e = {"8b": {"quantizations": {"none": model_run(b1=6.0, floor=5.0, batch=20.0, prefill=100.0),
                                    "int4": {"quantization": "int4", "step_weight_bytes": 1.5e9, "floor_step_ms": 1.5,
                                             "batch1_step_ms": 2.0, "batch1_step_vs_floor": 2.0 / 1.5}}}}
    kernels.report({"end_to_end": e2e}, [], 1e12, "test card", tmp_path / "kernels.json")
    assert set(json.loads((tmp_path / "kernels.json").read_text())["verdicts"]) == {
        "8b_bf16_batch1_step_vs_floor", "8b_w4a16_batch1_step_vs_floor", "8b_w4a16_batch1_speedup"}
    assert "8b    int4        1.50    1.50     2.00    1.33       -         -             -" in capsys.readouterr().out


def attention_row(batch: int, context: int, share: float) -> dict:
    return {"batch": batch, "context": context, "triton_copy_share": share}


def model_run(b1: float, floor: float, batch: float, prefill: float) -> dict:
    return {"step_weight_bytes": floor * 1e9, "batch1_step_ms": b1, "floor_step_ms": floor, "batch1_step_vs_floor": b1 / floor,
            f"batch{DECODE_BATCH}_step_ms": batch, f"prefill{PREFILL_TOKENS}_ms": prefill}


def test_verdicts_hold_each_measurement_to_its_issue_36_target():
    rows = [attention_row(1, 2048, 0.10),  # below 4k: not judged
            attention_row(1, 4096, 0.55), attention_row(1, 8192, 0.49),
            attention_row(4, 4096, 0.20),  # between batch 1 and 8: not judged
            attention_row(8, 4096, 0.71), attention_row(64, 16384, 0.90)]
    e2e = {"8b": {"quantizations": {"none": model_run(b1=6.0, floor=5.0, batch=20.0, prefill=100.0),
                                    "int4": model_run(b1=2.0, floor=1.5, batch=21.0, prefill=120.0)},
                  "runtime_mixed": {"tok_s": 5000.0}, "transformers": {"tok_s": 400.0}, "vs_transformers": 12.5}}
    checks = verdicts(rows, e2e)
    summary = {name: (round(c["value"], 4), c["target"], c["met"]) for name, c in checks.items()}
    assert summary == {
        "decode_attention_copy_share_min_batch_1_4k+": (0.49, ">= 0.5", False),
        "decode_attention_copy_share_min_batch_8+_4k+": (0.71, ">= 0.7", True),
        "8b_bf16_batch1_step_vs_floor": (1.2, "<= 1.2", True),
        "8b_w4a16_batch1_step_vs_floor": (1.3333, "<= 1.5", True),
        "8b_w4a16_batch1_speedup": (3.0, ">= 2.5", True),
        f"8b_w4a16_batch{DECODE_BATCH}_step_ms_vs_bf16": (1.05, "<= 1.0", False),
        f"8b_w4a16_prefill{PREFILL_TOKENS}_ms_vs_bf16": (1.2, "<= 1.3", True),
        "8b_vs_transformers": (12.5, ">= 10.0", True)}


def test_a_model_measured_without_int4_gets_only_its_bf16_verdicts():
    e2e = {"1b": {"quantizations": {"none": model_run(b1=1.6, floor=1.0, batch=5.0, prefill=30.0)}}}
    checks = verdicts([], e2e)
    assert {name: c["met"] for name, c in checks.items()} == {"1b_bf16_batch1_step_vs_floor": False}


def test_the_verdicts_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    e2e = {"1b": {"quantizations": {"none": model_run(b1=1.4, floor=1.0, batch=5.0, prefill=30.0)}}}
    png = write_png(tmp_path / "v.png", draw_verdicts, verdicts([attention_row(8, 4096, 0.8)], e2e), "test card")
    assert png.stat().st_size > 0
