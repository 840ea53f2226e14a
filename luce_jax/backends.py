"""The implementation each op runs with, by EngineConfig's resolved backend names: the Pallas
kernels, or their XLA / jnp counterparts."""

from __future__ import annotations

import functools
import importlib


def attention_fn(backend: str):
    """The paged attention implementation of a resolved attention_backend."""
    if backend == "pallas":
        from pallas_kernels.paged_attention import paged_attention

        return paged_attention
    from .models.attention import paged_attention_xla

    return paged_attention_xla


def pallas_only(backend: str, module: str, name: str):
    """The kernel `name` of pallas_kernels.`module` with the pallas backend, else None: the
    model then runs its XLA ops or the kernel's jnp reference in its place."""
    if backend != "pallas":
        return None
    return getattr(importlib.import_module(f"pallas_kernels.{module}"), name)


def gated_delta_fn(backend: str):
    """A hybrid model's gated delta rule for a resolved attention_backend (the sequence mixers
    go together: pallas on GPU, the jnp reference on CPU)."""
    if backend == "pallas":
        from pallas_kernels.gated_delta import gated_delta_in_place

        # Whole chunks of 16 kept tokens in the chunked (WY) form, the rest token by token
        # (decode rows). On the H200 the kernel took 13.1 ms of a 45.9 ms 512-token prompt
        # step of the 27B hybrid (bench/results/hybrid_qwen35-27b_h200.md).
        return functools.partial(gated_delta_in_place, chunk=16)
    from pallas_kernels.gated_delta import gated_delta_in_place_reference

    return gated_delta_in_place_reference


def grouped_matmul_fn(backend: str):
    """The grouped expert matmul of a resolved moe_backend."""
    if backend == "pallas":
        from pallas_kernels.moe_grouping import grouped_matmul

        return grouped_matmul
    from .models.moe import grouped_matmul_xla

    return grouped_matmul_xla


def moe_router_fn(backend: str):
    """The MoE router of a resolved moe_backend: with pallas, XLA's dot for the logits and one
    kernel for the scores, top-k and weights (pallas_kernels/moe_router.py); else None, XLA's
    ops. 30B-A3B Q4_K_M decode on the H100: 231 tok/s at C1 against 190 with XLA's routing and
    230 before the MoE decode work
    (bench/results/history/2026-12-05_engine_decode_moe_router_dot_h100.md). The one-kernel form
    (`fused_dot`, a program per row reading the whole router matrix) made it slower on the
    H200: 95 against 204 tok/s at C1 (history/2026-12-05_engine_decode_moe_router_h200.md)."""
    if backend != "pallas":
        return None
    from pallas_kernels.moe_router import moe_router

    return functools.partial(moe_router, fused_dot=False)


def quant_matmul_fn(backend: str, activations: str = "int8"):
    """How projections with quantized weights run, for a resolved quant_backend and
    EngineConfig.quant_activations (resolved: int8 or float)."""
    from .models.linear import QuantMatmul

    assert activations in ("int8", "float"), activations

    if backend == "pallas":
        from pallas_kernels.dequantize import dequantized_matmul
        from pallas_kernels.expert_rows import expert_rows
        from pallas_kernels.int8_rows import glu_int8_rows, norm_int8_rows, norm_rows

        from .step_format import SMALLEST_TOKEN_BUCKET

        int8 = activations == "int8"
        kernel = functools.partial(served_quant_matmul, int8_x=int8)
        return QuantMatmul(kernel, live_rows_max=SMALLEST_TOKEN_BUCKET, prefill=dequantized_matmul,
                           norm_int8=norm_int8_rows if int8 else None,
                           norm=None if int8 else norm_rows,
                           glu_int8=glu_int8_rows if int8 else None,
                           expert_rows=expert_rows)  # fmt: skip
    return QuantMatmul()


# The types whose dots (calls of more live rows than the vector path takes, and calls of 16 to
# 64 rows) run on x's int8 rows and int8 codes when activations are int8. Q4_K's shortened the
# 8B Q4_K_M's device step by 10% at C4 and C8 (7.49 -> 6.74 ms, 7.67 -> 6.89), left C16 even
# and lengthened C1's by 4% (3.86 -> 4.04: the kernel carries the branch C1 does not take);
# Q8_0's were even at C4 and C8 and slower at C1 (bench/results/
# history/2026-12-02_engine_decode_qwen3-8b-q4_k_m_int8_dots_6ec2d5b.md,
# ..._q8_0_int8_dots_2b8d095.md).
SERVED_INT8_DOTS = ("q4_k",)


def served_quant_matmul(x, w, live=None, *, int8_x: bool, **kw):
    """pallas_kernels.quant_matmul as the engine runs it: int8 dots for SERVED_INT8_DOTS."""
    from pallas_kernels.quant_matmul import quant_matmul

    dots = int8_x and w.qtype in SERVED_INT8_DOTS
    return quant_matmul(x, w, live, int8_x=int8_x, int8_dots=dots, **kw)


def kernels(config):
    """The Kernels a model's forward pass runs with under a resolved EngineConfig (its
    attention, MoE and quant backends, and its quantized projections' activations)."""
    from .models.family import Kernels

    return Kernels(
        attention=attention_fn(config.attention_backend),
        grouped_matmul=grouped_matmul_fn(config.moe_backend),
        quant_matmul=quant_matmul_fn(config.quant_backend, config.quant_activations),
        # q and k's norms, rope and the KV write in one kernel (pallas_kernels/rope_write.py)
        rope_write=pallas_only(config.attention_backend, "rope_write", "rope_write"),
        gated_delta=gated_delta_fn(config.attention_backend),
        moe_router=moe_router_fn(config.moe_backend),
        # DeepSeek V4's attention with sinks over keys gathered by row, and its
        # hyper-connections' Sinkhorn normalization in one launch (XLA ran it as a loop)
        sink_attention=pallas_only(config.attention_backend, "sink_attention", "sink_attention"),
        sinkhorn=pallas_only(config.attention_backend, "sinkhorn", "sinkhorn"),
    )
