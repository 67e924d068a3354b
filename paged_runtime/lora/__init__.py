"""LoRA adapters served over one base model (vLLM's ``--enable-lora``).

- ``request.py``: ``LoRARequest`` (which adapter a request runs with) and ``LoRAConfig`` (the engine's bounds);
  torch-free, so the front ends and the scheduler read them.
- ``peft.py``: a PEFT adapter folder read and checked against the model, as each layer's ``(A, B)`` parts.
- ``slots.py``: ``LoRASlots``, the worker's fixed-size table of adapters on the device (``max_loras`` slots,
  ``max_cpu_loras`` more kept in host memory, least recently used out) and each step's row -> slot map.

The per-row product itself is the op set's ``lora_delta`` (``layers/ops.py``, ``layers/lora.py``).
"""
