"""--quantization int8 / int4 end to end, and the GGUF's own Q4_1 blocks: perplexity of the embedded SmolLM2
against bfloat16 (its dequantized weights) on the text in tests/data (the real figures are printed), greedy
agreement, smaller resident weights, bad names refused, and the tiny random Llama quantized on one rank and
on two tensor-parallel ranks."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from paged_runtime import LLM, SamplingParams
from paged_runtime.layers.quantization import resident_bytes
from paged_runtime.utils.perplexity import perplexity

pytestmark = [pytest.mark.slow]

TEXT = Path(__file__).resolve().parents[1] / "data" / "lighthouse_keepers.txt"
MODES = ("none", "int8", "int4", "gguf")
SCORED_TOKENS, WINDOW = 1024, 512  # the first half of the text keeps the three engines' scoring short
PROMPTS = ["The capital of France is", "A lighthouse keeper's work began", "def fibonacci(n):",
           "Three things every sailor knows:"]


@pytest.fixture(scope="module")
def engines(smollm2_dir, smollm2_plain_dir):
    """int8 / int4 quantize the plain (dequantized) checkpoint at load; gguf serves the file's blocks (in
    bfloat16 every product is the CPU kernels')."""
    engines = {mode: LLM(str(smollm2_dir if mode == "gguf" else smollm2_plain_dir), dtype="bfloat16",
                         quantization=mode, max_model_len=1024, kv_cache_memory=64 << 20, seed=0)
               for mode in MODES}
    yield engines
    for llm in engines.values():
        llm.engine.core.shutdown()


@pytest.fixture(scope="module")
def perplexities(engines):
    ids = engines["none"].get_tokenizer().encode(TEXT.read_text())[:SCORED_TOKENS]
    result = {mode: perplexity(llm, ids, WINDOW) for mode, llm in engines.items()}
    print("\nperplexity over", len(ids), "tokens:",
          ", ".join(f"{m} {p:.3f} ({p / result['none'] - 1:+.2%})" for m, p in result.items()))
    return result


def test_int8_perplexity_is_within_1_percent_of_bfloat16(perplexities):
    """The quality bar, not a measured figure: 255 levels per output channel change each weight by at most
    half a step (0.4% of the channel's largest); a wrong scale or layout costs tens of percent."""
    assert perplexities["int8"] <= 1.01 * perplexities["none"], perplexities


@pytest.mark.xfail(strict=True, reason="SmolLM2 here comes from a Q4_1 GGUF: its weights already lie on 4-bit grids "
                                       "of 32 columns, which groups of 128 cannot follow (measured +80%)")
def test_int4_perplexity_is_within_10_percent_of_bfloat16(perplexities):
    assert perplexities["int4"] <= 1.10 * perplexities["none"], perplexities


def test_gguf_q4_1_perplexity_is_within_10_percent_of_bfloat16(perplexities):
    """The same weights, multiplied from their blocks (activations rounded to 8 bits per block of 32 by the
    CPU kernels, as llama.cpp does). The bar is llama.cpp's for 4-bit files (Q4 costs a few percent of
    perplexity there); the weights are the same, only the activations' rounding differs."""
    assert perplexities["gguf"] <= 1.10 * perplexities["none"], perplexities


def test_int4_perplexity_stays_bounded(perplexities):
    """Guards the arithmetic: a wrong kernel layout or zero point gives perplexities in the thousands."""
    assert perplexities["int4"] <= 2.0 * perplexities["none"], perplexities


def test_int8_greedy_outputs_mostly_follow_bfloat16(engines):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {m: [o.outputs[0].token_ids for o in engines[m].generate(PROMPTS, params, use_tqdm=False)]
            for m in ("none", "int8")}
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
            for x, y in zip(outs["none"], outs["int8"])]
    print("\nint8 tokens matching bfloat16 before the first difference (of 16):", same)
    # A near-tie may flip a token and all that follows, on any prompt; a quarter of the tokens in agreement
    # overall is the floor a working int8 keeps (a wrong one parts at the first token of every prompt).
    assert sum(same) >= len(PROMPTS) * 16 // 4, same


def test_quantized_models_hold_fewer_weight_bytes(engines):
    models = {m: llm.engine.core.executor.worker.model for m, llm in engines.items()}
    sizes = {m: resident_bytes(model) for m, model in models.items()}
    layers = {m: resident_bytes(model.layers) for m, model in models.items()}
    print("\nresident bytes (whole model / decoder layers):", {m: (sizes[m], layers[m]) for m in MODES})
    assert layers["int8"] <= 0.51 * layers["none"] and layers["int4"] <= 0.30 * layers["none"], layers
    assert sizes["int4"] < sizes["int8"] < sizes["none"]  # embeddings and LM head stay bfloat16
    assert not any(name.endswith("proj.weight") for name, _ in models["int8"].named_parameters())
    # Q4_1: 20 bytes per 32 weights (0.3125x bfloat16; 0.314x with the layers' norms and rotary tables); the
    # file's Q8_0 embedding (34 bytes per 32) is the LM head too.
    assert layers["gguf"] <= 0.315 * layers["none"], layers
    assert sizes["gguf"] <= 0.37 * sizes["none"], sizes
    assert not any(name.endswith(".weight") and "norm" not in name for name, _ in models["gguf"].named_parameters())


def test_a_bad_quantization_name_is_refused_with_the_choices(capsys, smollm2_dir, tiny_llama_dir):
    from paged_runtime.config import EngineConfig
    from paged_runtime.entrypoints.cli import build_parser
    with pytest.raises(ValueError, match=r"quantization must be one of none, int8, int4, .*; got 'fp4'"):
        EngineConfig(quantization="fp4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp4"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp4'" in err and all(f"'{name}'" in err for name in ("none", "int8", "int4")), err
    with pytest.raises(ValueError, match="quantized as 'gguf'; quantization 'int8' contradicts it"):
        LLM(str(smollm2_dir), quantization="int8")
    with pytest.raises(ValueError, match="quantization 'gguf' is a checkpoint format"):
        LLM(str(tiny_llama_dir), quantization="gguf")


def fake_quantized(folder: Path, out: Path, quantization: str) -> Path:
    """A copy of ``folder`` whose decoder-layer matrices are dequantize(quantize(W)) in float32."""
    from safetensors.torch import load_file, save_file
    from paged_runtime.layers.quantization.int4 import dequantize_int4, quantize_int4
    from paged_runtime.layers.quantization.int8 import dequantize_int8, quantize_int8
    out.mkdir()
    for file in folder.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
            continue
        tensors = load_file(file)
        for name, w in tensors.items():
            if name.startswith("model.layers.") and name.endswith("proj.weight"):
                tensors[name] = (dequantize_int8(*quantize_int8(w, w.dtype)) if quantization == "int8" else
                                 dequantize_int4(*quantize_int4(w, w.dtype), w.shape[1])).to(w.dtype).contiguous()
        save_file(tensors, out / file.name)
    return out


def greedy(folder: Path, quantization: str | None = None, tp: int = 1) -> list[list[int]]:
    llm = LLM(str(folder), quantization=quantization, tensor_parallel_size=tp, max_model_len=128,
              kv_cache_memory=8 << 20, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    finally:
        llm.engine.core.shutdown()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_llama_quantized_computes_as_its_dequantized_weights(tiny_llama_dir, tmp_path, quantization):
    """float32 takes the dequantize path (CUDA's): token for token what the plain model computes from the
    dequantized weights (the random model's tokens themselves move with any change of its weights)."""
    want = greedy(fake_quantized(Path(tiny_llama_dir), tmp_path / "fake", quantization))
    assert greedy(tiny_llama_dir, quantization) == want


@pytest.mark.parallel
def test_tiny_llama_int4_runs_on_two_tensor_parallel_ranks(tiny_llama_dir):
    """Each rank quantizes its own shard (row-parallel shards of 80 columns are padded to a group of 128):
    the numbers differ from one rank's, so this checks that sharded quantized loading runs."""
    tokens = greedy(tiny_llama_dir, "int4", tp=2)
    assert [len(t) for t in tokens] == [8, 8]
