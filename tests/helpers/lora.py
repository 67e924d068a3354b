"""PEFT LoRA adapters made in the test run (peft over a tiny random model's folder), and peft's greedy oracle."""
from __future__ import annotations

from pathlib import Path

import torch

# Three adapters of different ranks and target sets (tiny Llama's module names).
ADAPTERS = {
    "sql": dict(r=8, targets=["q_proj", "v_proj"], seed=1),
    "chat": dict(r=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 seed=2, rslora=True),
    "mlp": dict(r=4, targets=["gate_proj", "down_proj"], seed=3),
}


def make_adapter(base_dir: Path, out: Path, r: int, targets: list[str], seed: int, rslora: bool = False,
                 std: float = 0.3) -> Path:
    """A PEFT adapter of rank ``r`` over ``targets``, its A and B drawn at ``std`` (large enough that the adapter
    changes greedy outputs), saved as adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False, use_rslora=rslora))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data.normal_(0, std)
    model.save_pretrained(out)
    return out


def make_adapters(base_dir: Path, root: Path, specs: dict = ADAPTERS) -> dict[str, Path]:
    return {name: make_adapter(base_dir, root / name, **spec) for name, spec in specs.items()}


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers (+ peft's unmerged forward) greedy completions: the oracle's tokens."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None, temperature=None)
        outs.append(ids[0, len(prompt):].tolist())
    return outs
