"""Bytes that must move and FLOPs per decode step, against the HBM bandwidth measured in a run.

A decode step over R rows (one token each) with C-token contexts must read every weight that
its tokens use once, read each row's KV and write the new K/V. The weights count as stored in
the file (what llama.cpp reads: q8_0 is 8.5 bits a weight) and as luce_jax holds them after
dequantizing to bf16 (`--held-bits`). Expert tensors (`*_exps`) count only the experts the rows
are expected to touch under uniform routing: E * (1 - (1 - k/E)^R) of E.

    python bench/roofline.py --model qwen3-8b-bf16.gguf --rows 1 8 32 --ctx 1024 --measure
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from luce_jax.loading.gguf import GGUFFile


def copy_bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    """Bytes/s of an XLA elementwise copy on the default device (read + write counted)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 2)
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x)
    y.block_until_ready()
    return 2 * x.nbytes * reps / (time.perf_counter() - t)


@dataclass(frozen=True)
class ModelBytes:
    """Per-file sizes that a decode step's cost depends on."""

    dense_bytes: int  # weights every token reads, as stored (embedding table excluded if untied)
    dense_elems: int  # their element count
    dense_matmul_elems: int  # elements of 2-D matrices among them (2 FLOPs per token each)
    expert_bytes: int  # all `*_exps` tensors as stored
    expert_elems: int
    n_experts: int
    n_used: int
    n_layers: int
    kv_elems_per_token: int  # K and V elements per token over all layers
    attn_width: int  # H * D (query heads times head dim)


def model_bytes(path: str) -> ModelBytes:
    """Sizes read from a GGUF's header (no tensor data is touched)."""
    f = GGUFFile(path)
    md = f.metadata
    arch = md["general.architecture"]
    tied = "output.weight" not in f.tensors
    dense_b = dense_e = mm_e = exp_b = exp_e = 0
    for name, t in f.tensors.items():
        elems = 1
        for s in t.shape:
            elems *= s
        if name == "token_embd.weight" and not tied:
            continue  # only the step's T rows are gathered
        if "_exps" in name:
            exp_b, exp_e = exp_b + t.nbytes, exp_e + elems
            continue
        dense_b, dense_e = dense_b + t.nbytes, dense_e + elems
        if len(t.shape) == 2:
            mm_e += elems
    n_layers = md[f"{arch}.block_count"]
    heads = md[f"{arch}.attention.head_count"]
    kv_heads = md.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = md.get(f"{arch}.attention.key_length", md[f"{arch}.embedding_length"] // heads)
    return ModelBytes(
        dense_bytes=dense_b,
        dense_elems=dense_e,
        dense_matmul_elems=mm_e,
        expert_bytes=exp_b,
        expert_elems=exp_e,
        n_experts=md.get(f"{arch}.expert_count", 0),
        n_used=md.get(f"{arch}.expert_used_count", 0),
        n_layers=n_layers,
        kv_elems_per_token=2 * n_layers * kv_heads * head_dim,
        attn_width=heads * head_dim,
    )


@dataclass(frozen=True)
class StepCost:
    bytes: float  # weights + KV read + KV written
    weight_bytes: float
    kv_bytes: float
    flops: float

    def tok_s(self, rows: int, bandwidth: float) -> float:
        """Decode tokens/s if the step ran at `bandwidth` bytes/s (the memory roofline)."""
        return rows * bandwidth / self.bytes


def decode_step(
    m: ModelBytes, rows: int, ctx: int, held_bits: float | None = None, kv_bytes: float = 2
) -> StepCost:
    """Cost of one decode step of `rows` sequences at `ctx` tokens of context each.

    Args:
      m: model_bytes() of the file.
      rows: decode rows R in the step.
      ctx: KV length per row.
      held_bits: bits per weight as held in memory (16 for bf16); None = as stored in the file.
      kv_bytes: bytes per KV element (2 for bf16).
    """
    dense = m.dense_bytes if held_bits is None else m.dense_elems * held_bits / 8
    experts = m.expert_bytes if held_bits is None else m.expert_elems * held_bits / 8
    touched = 0.0
    if m.n_experts:
        touched = 1 - (1 - m.n_used / m.n_experts) ** rows
    weights = dense + experts * touched
    kv = rows * (ctx + 1) * m.kv_elems_per_token * kv_bytes
    used_expert_elems = m.expert_elems * m.n_used / m.n_experts if m.n_experts else 0
    flops = 2 * rows * (m.dense_matmul_elems + used_expert_elems)
    flops += 4 * rows * ctx * m.attn_width * m.n_layers  # QK^T and PV
    return StepCost(weights + kv, weights, kv, flops)


def markdown(m: ModelBytes, rows: list[int], ctx: int, bandwidth: float, held_bits) -> str:
    lines = [
        f"Decode roofline at {ctx}-token contexts, bandwidth {bandwidth / 1e9:.0f} GB/s.",
        "",
        "| rows | GB per step (file) | GFLOP per step | FLOP/byte | roofline tok/s (file) |"
        + (f" roofline tok/s (held at {held_bits:g} bits) |" if held_bits else ""),
        "| --- | --- | --- | --- | --- |" + (" --- |" if held_bits else ""),
    ]
    for r in rows:
        c = decode_step(m, r, ctx)
        line = (
            f"| {r} | {c.bytes / 1e9:.2f} | {c.flops / 1e9:.1f} | {c.flops / c.bytes:.1f} | "
            f"{c.tok_s(r, bandwidth):.0f} |"
        )
        if held_bits:
            line += f" {decode_step(m, r, ctx, held_bits).tok_s(r, bandwidth):.0f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--held-bits", type=float, default=16.0, help="0: only the file's sizes")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--bandwidth", type=float, help="GB/s")
    g.add_argument("--measure", action="store_true", help="measure the copy bandwidth now")
    a = ap.parse_args()
    bw = copy_bandwidth() if a.measure else a.bandwidth * 1e9
    sys.stdout.write(markdown(model_bytes(a.model), a.rows, a.ctx, bw, a.held_bits or None))


if __name__ == "__main__":
    main()
