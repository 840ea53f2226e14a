"""SwiGLU's gate, clamped where a model sets a limit: DeepSeek V4 computes
silu(min(gate, L)) * clip(up, -L, L) with L = swiglu_limit (transformers'
DeepseekV4Experts._apply_gate, llama.cpp's ggml_swiglu_clamp); every other model has none.
One definition for the jnp references, XLA's paths and the kernels' epilogues."""

from __future__ import annotations

import jax.numpy as jnp


def swiglu(gate, up, limit: float = 0.0):
    """silu(gate) * up, with gate and up clamped first where limit > 0 (float32 math; silu
    written out, as Triton lowers it)."""
    if limit:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return gate / (1.0 + jnp.exp(-gate)) * up
