"""Pre-quantized checkpoints and FP8 end to end on a tiny random Llama (hidden 128, intermediate 256: whole
groups of 128).

compressed-tensors checkpoints are made by the compressed-tensors library (W8A16, W4A16 symmetric and
asymmetric, FP8 static and dynamic) and their dequantized weights read back by the same library; GPTQ and
AWQ checkpoints are written here by their published layouts (the packing itself is checked against
independent readers in tests/unit/test_checkpoint_formats.py). Each checkpoint must generate, greedily, the
tokens the engine generates from its dequantized weights saved as a plain folder (same weights; only the
arithmetic differs), hold exactly the bytes its format stores, and refuse a contradicting --quantization.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import copy_tokenizer, make_llm, save_tiny_llama
from paged_runtime import SamplingParams
from paged_runtime.layers.linear import LinearBase
from paged_runtime.layers.quantization import resident_bytes
from paged_runtime.utils.perplexity import prompt_logprobs
from tests.unit.test_checkpoint_formats import awq_tensors, gptq_tensors

TEXT = Path(__file__).resolve().parents[1] / "data" / "lighthouse_keepers.txt"
PROMPTS = ["The capital of France is", "A lighthouse keeper's work began", "def fibonacci(n):"]
GROUP = 128
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny128_dir(tmp_path_factory, smollm2_dir):
    """conftest's tiny Llama, widened so every linear layer's inputs are whole groups of 128."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny128"), smollm2_dir, hidden_size=128, intermediate_size=256)


def run(folder: Path, quantization: str | None = None):
    """(greedy tokens of PROMPTS, the decoder layers' linear bytes, their [N, K] shapes, prompt logprobs of
    the first 128 tokens of tests/data's text)."""
    llm = make_llm(folder, quantization=quantization, max_model_len=160, kv_cache_memory=8 << 20, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        model = llm.engine.core.executor.worker.model
        linear = [m for m in model.layers.modules() if isinstance(m, LinearBase)]
        logprobs = prompt_logprobs(llm, llm.get_tokenizer().encode(TEXT.read_text())[:128], 128)
        return tokens, sum(resident_bytes(m) for m in linear), [(m.output_size, m.input_size) for m in linear], logprobs
    finally:
        llm.engine.core.shutdown()


def rewrite(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    """A copy of ``src`` with ``tensors`` as its weights and ``quantization_config`` in its config.json."""
    out.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- GPTQ and AWQ: written by their layouts -------------------------------------------------------------------

def quantize_groups(w: torch.Tensor, symmetric: bool, min_zero: int = 0):
    """(codes [N, K], zeros [N, K / 128], float16 scales [N, K / 128]) of a [N, K] weight, 4-bit."""
    g = w.view(w.shape[0], -1, GROUP)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).half()
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        low, high = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = ((high - low) / 15).half()
        zero = (-low / scale.float()).round().clamp(min_zero, 15).long()
    codes = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15).long()
    return codes.view(w.shape), zero, scale


def dequantized_groups(codes, zeros, scales) -> torch.Tensor:
    return (codes - zeros.repeat_interleave(GROUP, 1)).float() * scales.float().repeat_interleave(GROUP, 1)


def packed_checkpoint(src: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    """(the GPTQ / AWQ checkpoint, a plain folder of its dequantized weights)."""
    tensors = load_file(src / "model.safetensors")
    packed, plain = {}, {}
    for name, w in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2] not in LINEAR:
            packed[name] = plain[name] = w
            continue
        parts = quantize_groups(w, symmetric=fmt == "gptq-sym", min_zero=1 if fmt == "gptq" else 0)
        plain[name] = dequantized_groups(*parts)
        written = awq_tensors(*parts) if fmt == "awq" else gptq_tensors(*parts)
        packed.update({f"{module}.{key}": t for key, t in written.items()})
    config = ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
              if fmt == "awq" else {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                    "sym": fmt == "gptq-sym", "checkpoint_format": "gptq"})
    return rewrite(src, out / fmt, packed, config), rewrite(src, out / f"{fmt}-plain", plain, None)


# ---- compressed-tensors: made by the library --------------------------------------------------------------

def input_amax(model, prompt_ids: list[int]) -> dict[str, float]:
    """Each Linear's largest absolute input over a prompt (static FP8 activation scales are calibrated so)."""
    amax, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: amax.__setitem__(name, max(amax.get(name, 0), args[0].abs().max().item()))))
    with torch.no_grad():
        model(torch.tensor([prompt_ids]))
    for hook in hooks:
        hook.remove()
    return amax


def compressed_checkpoint(src: Path, out: Path, preset: str) -> tuple[Path, Path]:
    """(a compressed-tensors checkpoint by the library, a plain folder of the weights it decompresses to)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoTokenizer, LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    amax = input_amax(model, AutoTokenizer.from_pretrained(src).encode(" ".join(PROMPTS)))
    if preset.startswith("W8A16"):  # per output channel (the library's W8A16 preset is now grouped)
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int",
                                                                                 strategy="channel"))
    else:
        scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for name, module in model.named_modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.data
        if args.strategy == "group":
            w = w.view(w.shape[0], -1, args.group_size)
            low, high = w.amin(-1), w.amax(-1)
        elif args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(amax[name] / torch.finfo(torch.float8_e4m3fn).max)
    # The library packs 8-bit integers into int32 by default; W8A16 is also written as plain int8.
    compressor = ModelCompressor.from_pretrained_model(model, "int-quantized" if preset == "W8A16" else None)
    compressor.compress_model(model)
    folder = out / preset
    model.save_pretrained(folder, safe_serialization=True)
    compressor.update_config(str(folder))
    written = json.loads((folder / "config.json").read_text())["quantization_config"]["format"]
    assert written == ("int-quantized" if preset == "W8A16" else "float-quantized" if preset.startswith("FP8")
                       else "pack-quantized")
    copy_tokenizer(src, folder)
    compressor.decompress_model(model)
    names = load_file(src / "model.safetensors").keys()
    state = model.state_dict()
    plain = rewrite(src, out / f"{preset}-plain", {name: state[name].float() for name in names}, None)
    assert ct.__version__
    return folder, plain


# ---- the checks --------------------------------------------------------------------------------------------

def int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + (k // GROUP) * n * 2 * 4  # codes, then float32 scale and zero per group


FORMATS = {  # name -> (how it is made, its linear layers' bytes for [N, K] in float32)
    "gptq": (packed_checkpoint, int4_bytes),
    "gptq-sym": (packed_checkpoint, int4_bytes),
    "awq": (packed_checkpoint, int4_bytes),
    "W4A16": (compressed_checkpoint, int4_bytes),
    "W4A16_ASYM": (compressed_checkpoint, int4_bytes),
    "W8A16": (compressed_checkpoint, lambda n, k: n * k + 4 * n),
    "W8A16_PACKED": (compressed_checkpoint, lambda n, k: n * k + 4 * n),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_checkpoint_generates_what_its_dequantized_weights_generate(tiny128_dir, tmp_path, fmt):
    make, layer_bytes = FORMATS[fmt]
    checkpoint, plain = make(tiny128_dir, tmp_path, fmt)
    tokens, size, shapes, _ = run(checkpoint)
    want, plain_size, _, _ = run(plain)
    assert tokens == want
    assert size == sum(layer_bytes(n, k) for n, k in shapes)
    assert plain_size == sum(4 * n * k for n, k in shapes)


@pytest.fixture(scope="module")
def fp8_at_load(tiny128_dir):
    return run(tiny128_dir, "fp8")


def test_a_dynamic_fp8_checkpoint_computes_as_fp8_at_load(tiny128_dir, tmp_path, fp8_at_load):
    """compressed-tensors' FP8_DYNAMIC (weights per channel, activations per token) is what --quantization fp8
    makes of the same weights: the same float8 values and scales, the same products."""
    checkpoint, _ = compressed_checkpoint(tiny128_dir, tmp_path, "FP8_DYNAMIC")
    tokens, size, shapes, logprobs = run(checkpoint)
    assert tokens == fp8_at_load[0] and logprobs == fp8_at_load[3]
    assert size == fp8_at_load[1] == sum(n * k + 4 * n for n, k in shapes)


# W8A8's activations are quantized too (3 mantissa bits), which moves this random model's logprobs by a
# fraction of a nat on average and can flip its greedy tokens from the first or second on (this random model
# is not peaked enough for token identity; its logprobs are around -15): measured against the unquantized
# weights over 127 tokens, mean |difference| 0.71 (at load) / 0.46 (static checkpoint), max 2.79 / 2.46
# nats. A wrong scale or layout moves them by tens of nats.
def assert_logprobs_near(logprobs: list[float], want: list[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(logprobs, want)]
    print(f"\nFP8 |logprob difference| over {len(diffs)} tokens: mean {sum(diffs) / len(diffs):.3f}, "
          f"max {max(diffs):.3f}")
    assert len(diffs) == 127 and sum(diffs) / len(diffs) <= 1.0 and max(diffs) <= 4.0, (sum(diffs) / 127, max(diffs))


def test_fp8_at_load_stays_near_the_unquantized_model(tiny128_dir, fp8_at_load):
    tokens, size, shapes, logprobs = fp8_at_load
    want_tokens, _, _, want = run(tiny128_dir)
    assert_logprobs_near(logprobs, want)


def test_a_static_fp8_checkpoint_stays_near_its_dequantized_weights(tiny128_dir, tmp_path):
    """FP8 with per-tensor weight scales and calibrated static activation scales (``input_scale``)."""
    checkpoint, plain = compressed_checkpoint(tiny128_dir, tmp_path, "FP8")
    tokens, size, shapes, logprobs = run(checkpoint)
    want_tokens, _, _, want = run(plain)
    assert [t[0] for t in tokens] == [t[0] for t in want_tokens]
    assert_logprobs_near(logprobs, want)
    assert size == sum(n * k + 4 * n + 4 for n, k in shapes)  # and the static input scale


def test_a_contradicting_or_unsupported_quantization_is_refused(tiny128_dir, tmp_path):
    checkpoint, _ = packed_checkpoint(tiny128_dir, tmp_path, "awq")
    with pytest.raises(ValueError, match="quantized as 'awq'; quantization 'int4' contradicts it"):
        make_llm(checkpoint, quantization="int4")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'bitsandbytes'.*supported: gptq, awq, compressed-tensors"):
        make_llm(checkpoint)


@pytest.mark.parallel
def test_a_gptq_checkpoint_runs_on_two_tensor_parallel_ranks(tmp_path, smollm2_dir):
    """Each rank takes its shard of the packed tensors (a Llama of hidden 256: the row-parallel o_proj and
    down_proj keep whole groups of 128 per rank); the tokens are one rank's."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.25)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "src", safe_serialization=True)
    copy_tokenizer(smollm2_dir, tmp_path / "src")
    checkpoint, _ = packed_checkpoint(tmp_path / "src", tmp_path, "gptq")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = make_llm(checkpoint, tensor_parallel_size=tp, max_model_len=128, kv_cache_memory=8 << 20,
                       max_num_seqs=4)
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        finally:
            llm.engine.core.shutdown()
    assert tokens[0] == tokens[1]


def test_a_bfloat16_gptq_checkpoint_through_the_int4_kernel_errs_as_bfloat16_does(tiny128_dir, tmp_path):
    """bfloat16 takes torch's int4 CPU kernel (its own tiling, scales rounded to bfloat16); greedy tokens of
    this unpeaked model flip under any bfloat16 rounding, so the check is on logprobs: the checkpoint stays
    as near the float32 dequantized weights as those weights run in bfloat16 do (measured mean |difference|
    0.087 against 0.082 nats)."""
    checkpoint, plain = packed_checkpoint(tiny128_dir, tmp_path, "gptq")
    want = run(plain)[3]
    errors = {}
    for name, folder in (("plain", plain), ("checkpoint", checkpoint)):
        llm = make_llm(folder, dtype="bfloat16", max_model_len=160, kv_cache_memory=8 << 20, max_num_seqs=4)
        try:
            down_proj = llm.engine.core.executor.worker.model.layers[0].mlp.down_proj
            assert getattr(down_proj, "int4_kernel", False) == (name == "checkpoint")
            logprobs = prompt_logprobs(llm, llm.get_tokenizer().encode(TEXT.read_text())[:128], 128)
        finally:
            llm.engine.core.shutdown()
        errors[name] = sum(abs(a - b) for a, b in zip(logprobs, want)) / len(want)
    print("\nbfloat16 mean |logprob difference| from float32:", errors)
    assert errors["checkpoint"] <= 1.5 * errors["plain"], errors
