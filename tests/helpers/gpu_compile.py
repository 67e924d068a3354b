"""Compiles the runtime's Triton kernels for a CUDA architecture on a machine without a GPU, as their launches
ask for them: every wrapper in ``paged_runtime.kernels`` is called on small CPU tensors with the shapes, dtypes
and constant expressions the runtime launches, and each launch is compiled by Triton's own compiler (Python
AST -> TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ``ptxas`` its wheel ships) instead of run. The CPU
tests otherwise run the kernels in Triton's interpreter, which accepts code the compiler refuses (a global that
is not a ``tl.constexpr``, a dot too small for the tensor cores, ...): without this, such a kernel first fails
on a GPU.

Run in a fresh process (the kernel modules must be defined compiled, not interpreted):
``python -m tests.helpers.gpu_compile 90`` prints one JSON object, launch -> "ok", the compiler's error, or
the shared memory it needs beyond the architecture's limit.
Written against Triton 3.9's ``JITFunction`` (``_pack_args``, ``create_function_from_signature``).
"""
from __future__ import annotations

import json
import os
import sys

import torch

assert not os.environ.get("TRITON_INTERPRET"), "the kernels must be defined compiled: unset TRITON_INTERPRET"

from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

RESULTS: dict[str, str] = {}
# The most shared memory one block may use, by architecture (CUDA's opt-in maximum): a kernel over it compiles
# but fails at launch ("out of resources").
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def compile_instead_of_launching(target: GPUTarget) -> None:
    """Every ``kernel[grid](...)`` compiles for ``target`` (as ``JITFunction.run`` would on that device) into
    RESULTS, and launches nothing."""
    backend = make_backend(target)

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        pointers = ",".join(t for t in signature.values() if t.startswith("*"))
        named = ",".join(f"{self.params[path[0]].name}={value}" for path, value in constexprs.items())
        label = f"{self.fn.__name__}[{pointers}]({named})"
        try:
            kernel = compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
            shared, limit = kernel.metadata.shared, SHARED_LIMIT[target.arch]
            RESULTS[label] = "ok" if shared <= limit else f"shared memory {shared} bytes > sm_{target.arch}'s {limit}"
        except Exception as e:  # noqa: BLE001: every compiler error is a result
            while e.__cause__ is not None:  # an error in a called @jit function: its own is the one that says why
                e = e.__cause__
            RESULTS[label] = f"{type(e).__name__}: {str(e).strip()[-1500:]}"

    JITFunction.run = run


def launch_everything() -> None:
    from paged_runtime.kernels import attention, fused, kv_quant, lora, quant_gemm, store_kv
    from paged_runtime.kernels.gguf_types import row_bytes
    from paged_runtime.layers.quantization.gguf_blocks import SERVED

    bf16 = torch.bfloat16
    for dtype in (bf16, torch.float16, torch.float32):  # the GPU's model dtypes (float32: the fidelity runs)
        cache = torch.empty(64, 2, 2, 128, dtype=dtype)
        k = torch.empty(3, 2, 128, dtype=dtype)
        store_kv.store_kv(k, k.clone(), cache, torch.zeros(3, dtype=torch.long))
        _attention(attention, torch.empty(5, 8, 128, dtype=dtype), cache)
        x, w = torch.empty(3, 256, dtype=dtype), torch.empty(256, dtype=dtype)
        fused.rms_norm(x, w, 1e-6)
        fused.rms_norm(x, w, 1e-6, residual=x.clone())
        fused.rope_(torch.empty(3, 12 * 64, dtype=dtype), 10, 64, torch.zeros(3, dtype=torch.long),
                    torch.empty(32, 64), torch.empty(32, 64))
        fused.silu_mul(torch.empty(3, 512, dtype=dtype))
        lora.lora_delta(torch.empty(3, 96, dtype=dtype), x, torch.empty(2, 3 * 8, 256, dtype=dtype),
                        torch.empty(2, 96, 8, dtype=dtype), torch.zeros(3, dtype=torch.long), (32, 32, 32))
        for m, split in ((1, None), (64, 1)):  # decode (K split) and prefill-sized (whole K) launches
            x = torch.empty(m, 512, dtype=dtype)
            quant_gemm.w8a16_linear(x, torch.empty(256, 512, dtype=torch.int8), torch.empty(256, dtype=dtype), split)
            quant_gemm.w4a16_linear(x, torch.empty(256, 256, dtype=torch.uint8), torch.empty(4, 256, 2, dtype=dtype),
                                    split)
            for t in SERVED.values():
                quant_gemm.gguf_linear(x, torch.empty(256, row_bytes(t, 512), dtype=torch.uint8), t.id, split)
    for name in ("fp8", "int8"):  # 8-bit caches (queries in bfloat16)
        cache = torch.empty(64, 2, 2, 128, dtype=kv_quant.cache_dtype(name, bf16))
        scale = kv_quant.allocate_scale(cache)
        store_kv.store_kv(torch.empty(3, 2, 128, dtype=bf16), torch.empty(3, 2, 128, dtype=bf16), cache,
                          torch.zeros(3, dtype=torch.long), scale)
        _attention(attention, torch.empty(5, 8, 128, dtype=bf16), cache, kv_scale=scale)


def _attention(attention, q, cache, **kwargs) -> None:
    """A mixed batch (prefill tiles), a decode batch in one pass and split over segments (and their reduction),
    and one with a sliding window and a soft cap, over 4 blocks of 16 per sequence."""
    tables = torch.zeros(2, 4, dtype=torch.int32)
    seq_lens = torch.full((2,), 60, dtype=torch.int32)
    mixed = torch.tensor([0, 4, 5], dtype=torch.int32)
    attention.paged_attention(q, cache, mixed, seq_lens, tables, 16, 4, 0.1, **kwargs)
    decode = torch.tensor([0, 1, 2], dtype=torch.int32)
    for splits in (1, 4):
        attention.paged_attention(q[:2], cache, decode, seq_lens, tables, 16, 1, 0.1, splits, **kwargs)
    attention.paged_attention(q[:2], cache, decode, seq_lens, tables, 16, 1, 0.1, window=32, softcap=30.0, **kwargs)


if __name__ == "__main__":
    from paged_runtime.kernels import store_kv
    arch = int(sys.argv[1])
    compile_instead_of_launching(GPUTarget("cuda", arch, 32))
    store_kv.fp8_native = lambda device: arch >= 89  # the wrappers choose as they would on that GPU
    launch_everything()
    print(json.dumps(RESULTS, indent=1))
