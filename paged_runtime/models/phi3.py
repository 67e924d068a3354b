"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer, loaded from fused checkpoints, with its own RoPE.

- Checkpoints hold ``qkv_proj`` ([q; k; v] rows) and ``gate_up_proj`` ([gate; up] rows) whole: each is
  split into its parts and loaded as the Llama checkpoints' q/k/v and gate/up are, so every
  tensor-parallel rank still takes its own heads and its own slice of the MLP.
- Partial rotary (Phi-4-mini rotates 3/4 of each head) and LongRoPE (Phi-3.5, Phi-4-mini) are the
  rotary's (``layers/rotary.py``), read from ``ModelConfig.rope_scaling``; a long prompt's tokens read
  the long half of its tables through ``rope_position_offset``.
- ``sliding_window`` applies to every layer, as transformers' mask does (``ModelConfig``).
The compiled one-op Llama layer rotates whole heads by true positions with no window, so a Phi-3 runs it
only when that is what the model computes.
"""
from __future__ import annotations

import torch

from paged_runtime.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    @property
    def one_op_layer(self) -> bool:
        return not self.config.layer_windows  # the rotary's own condition is checked by LlamaForCausalLM

    def fused_parts(self) -> dict[str, tuple[list[str], list[int]]]:
        """Fused checkpoint matrix -> (the Llama names of its parts, their rows), full (unsharded) sizes."""
        c = self.config
        kv = c.num_kv_heads * c.head_dim
        return {"qkv_proj": (["q_proj", "k_proj", "v_proj"], [c.num_heads * c.head_dim, kv, kv]),
                "gate_up_proj": (["gate_proj", "up_proj"], [c.intermediate_size] * 2)}

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """A fused tensor fills every shard of its parameter: its name comes back without a shard."""
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        parts = self.fused_parts().get(leaf)
        if parts is None:
            return super().load_weight(name, tensor)
        names, sizes = parts
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} rows, expected {sum(sizes)}")
        filled = {super(Phi3ForCausalLM, self).load_weight(f"{parent}.{part}.{param_name}", t)
                  for part, t in zip(names, tensor.split(sizes))}
        targets = {f.partition("#")[0] for f in filled if f is not None}
        return targets.pop() if len(targets) == 1 and None not in filled else None

    def expected_weights(self) -> set[str]:
        return {name.partition("#")[0] for name in super().expected_weights()}
