"""The output head every family ends in: the final norm, then the lm_head (or the tied
embedding table) over the rows whose logits a step wants. Shapes: T tokens, R logits rows, d
model width, V vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .linear import Normed, linear, unembed


def head(params: dict, x, batch: dict, cfg: ModelConfig, quant_matmul):
    """Logits [R, V] of the wanted rows (batch logit_rows) of the residual stream x [T, d]."""
    with jax.named_scope("lm_head"):
        # padding logits rows (offset -1) trail the real ones
        live_logits = jnp.sum(batch["logit_off"] >= 0) if "logit_off" in batch else None
        return logits_of(params, x[batch["logit_rows"]], cfg, quant_matmul, live_logits)


def logits_of(params: dict, rows, cfg: ModelConfig, quant_matmul, live=None):
    """Logits [R, V] float32 of residual-stream rows [R, d]: the final norm and the lm_head
    (live: how many leading rows are real, for the quantized kernel; None: all)."""
    return project(params, Normed(rows, params["final_norm"], cfg.rms_eps), quant_matmul, live)


def project(params: dict, h, quant_matmul, live=None):
    """Logits [R, V] float32 of normed rows h [R, d] (or Normed rows): the lm_head, or the tied
    embedding table, alone."""
    if quant_matmul is not None:  # unlike token buckets, any row bucket can hold one live
        # row (a lone prompt's last token), so the kernel always gets the live count
        quant_matmul = quant_matmul._replace(live_rows_max=quant_matmul.max_rows)
    if "lm_head" in params:
        return linear(h, params["lm_head"], quant_matmul, live)
    return unembed(h, params["embed"], quant_matmul, live)
