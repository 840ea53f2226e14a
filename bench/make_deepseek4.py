"""Random-weight DeepSeek V4 GGUFs (architecture deepseek4) for bench/make_model.py, with the
keys, tensor names and types llama.cpp 11434's converter writes (conversion/deepseek.py): the
routed experts in `--type` (MXFP4 as the converter writes them, or Q2_K / Q4_K as a quantizer
would), the other linears Q8_0 (BF16 with --type bf16), the compressors' and the indexer's
projections BF16, norms, hyper-connections, position biases and sinks F32. `layers` writes
the first N blocks at full width, for machines that cannot hold all of them.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

# Flash: 43 layers (2 window-only, then CSA and HCA in turn, CSA last), 64 heads of 512 with
# one shared K = V head, 256 experts (6 used) of 2048; the small one runs on a CPU in tests.
SHAPES = {
    "deepseek4-flash": dict(
        d=4096, L=43, H=64, D=512, r=64, Rq=1024, g=8, Ro=1024, W=128, HI=64, dI=128, topk=512,
        E=256, k=6, Fe=2048, hash=3, ratios=[0, 0] + [4, 128] * 20 + [4],
    ),
    "deepseek4-small": dict(
        d=256, L=4, H=4, D=128, r=64, Rq=256, g=2, Ro=128, W=16, HI=8, dI=64, topk=8, E=8, k=2,
        Fe=256, hash=1, ratios=[0, 4, 128, 4],
    ),
}  # fmt: skip
EXPERT_TYPES = {"mxfp4": T.MXFP4, "q2_k": T.Q2_K, "q4_k": T.Q4_K, "bf16": T.BF16}
N_HC, ARCH = 4, "deepseek4"


def keys(w, s: dict, n_layers: int) -> None:
    """The deepseek4.* metadata of shape s with its first n_layers blocks: ints as UINT32,
    floats as FLOAT32, as the converter writes them."""
    values = {
        "block_count": n_layers,
        "context_length": 1048576,
        "embedding_length": s["d"],
        "attention.head_count": s["H"],
        "attention.head_count_kv": 1,
        "attention.key_length": s["D"],
        "attention.value_length": s["D"],
        "rope.dimension_count": s["r"],
        "attention.q_lora_rank": s["Rq"],
        "attention.sliding_window": s["W"],
        "expert_count": s["E"],
        "expert_used_count": s["k"],
        "expert_gating_func": 4,
        "expert_feed_forward_length": s["Fe"],
        "expert_shared_count": 1,
        "attention.indexer.head_count": s["HI"],
        "attention.indexer.key_length": s["dI"],
        "attention.indexer.top_k": s["topk"],
        "attention.output_group_count": s["g"],
        "attention.output_lora_rank": s["Ro"],
        "hyper_connection.count": N_HC,
        "hyper_connection.sinkhorn_iterations": 20,
        "hash_layer_count": min(s["hash"], n_layers),
        "embedding_length_out": s["d"] * N_HC,
        "rope.scaling.original_context_length": 65536,
        "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "expert_weights_scale": 1.5,
        "attention.compress_rope_freq_base": 160000.0,
        "hyper_connection.epsilon": 1e-6,
        "rope.scaling.factor": 16.0,
        "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0,
    }
    for k, v in values.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"{ARCH}.{k}", v)
    w.add_string(f"{ARCH}.rope.scaling.type", "yarn")
    w.add_bool(f"{ARCH}.expert_weights_norm", True)
    w.add_array(f"{ARCH}.attention.compress_ratios", s["ratios"][:n_layers])
    w.add_array(f"{ARCH}.swiglu_clamp_exp", [10.0] * n_layers)
    w.add_array(f"{ARCH}.swiglu_clamp_shexp", [10.0] * n_layers)


def tensors(w, s: dict, n_layers: int, vocab: int, expert_type: str, mat, rng) -> None:
    """Every tensor of the first n_layers blocks and the model's ends. mat(name, rows, cols,
    qtype, experts=0) writes a random matrix [experts,] rows x cols of qtype."""
    d, H, D, E, Fe = s["d"], s["H"], s["D"], s["E"], s["Fe"]
    lin = T.BF16 if expert_type == "bf16" else T.Q8_0  # the converter's Q8_0 for FP8 linears

    def f32(name, *shape, scale=0.1, mean=0.0):
        w.add_tensor(name, (mean + scale * rng.standard_normal(shape)).astype(np.float32))

    mat("token_embd.weight", vocab, d, lin)
    mat("output.weight", vocab, d, lin)
    f32("output_norm.weight", d, mean=1.0)
    f32("output_hc_fn.weight", N_HC, N_HC * d, scale=0.02)
    f32("output_hc_base.weight", N_HC)
    f32("output_hc_scale.weight", 1)
    n_site = (2 + N_HC) * N_HC
    for i in range(n_layers):
        p, ratio = f"blk.{i}.", s["ratios"][i]
        for site in ("attn", "ffn"):
            f32(f"{p}hc_{site}_fn.weight", n_site, N_HC * d, scale=0.02)
            f32(f"{p}hc_{site}_base.weight", n_site)
            f32(f"{p}hc_{site}_scale.weight", 3)
        f32(p + "attn_norm.weight", d, mean=1.0)
        f32(p + "ffn_norm.weight", d, mean=1.0)
        f32(p + "attn_sinks.weight", H)
        mat(p + "attn_q_a.weight", s["Rq"], d, lin)
        f32(p + "attn_q_a_norm.weight", s["Rq"], mean=1.0)
        mat(p + "attn_q_b.weight", H * D, s["Rq"], lin)
        mat(p + "attn_kv.weight", D, d, lin)
        f32(p + "attn_kv_a_norm.weight", D, mean=1.0)
        mat(p + "attn_output_a.weight", s["g"] * s["Ro"], H * D // s["g"], lin)
        mat(p + "attn_output_b.weight", d, s["g"] * s["Ro"], lin)
        if ratio:
            width = 2 * D if ratio == 4 else D
            mat(p + "attn_compressor_kv.weight", width, d, T.BF16)
            mat(p + "attn_compressor_gate.weight", width, d, T.BF16)
            f32(p + "attn_compressor_ape.weight", ratio, width)
            f32(p + "attn_compressor_norm.weight", D, mean=1.0)
        if ratio == 4:
            dI = s["dI"]
            mat(p + "indexer.attn_q_b.weight", s["HI"] * dI, s["Rq"], T.BF16)
            mat(p + "indexer.proj.weight", s["HI"], d, T.BF16)
            mat(p + "indexer_compressor_kv.weight", 2 * dI, d, T.BF16)
            mat(p + "indexer_compressor_gate.weight", 2 * dI, d, T.BF16)
            f32(p + "indexer_compressor_ape.weight", 4, 2 * dI)
            f32(p + "indexer_compressor_norm.weight", dI, mean=1.0)
        f32(p + "ffn_gate_inp.weight", E, d, scale=0.02)
        if i < s["hash"]:  # routed by token id: each token its own k experts
            table = np.argsort(rng.random((vocab, E)), axis=1)[:, : s["k"]].astype(np.int32)
            w.add_tensor(p + "ffn_gate_tid2eid.weight", table)
        else:
            f32(p + "exp_probs_b.bias", E, scale=0.01)
        et = EXPERT_TYPES[expert_type]
        mat(p + "ffn_gate_exps.weight", Fe, d, et, E)
        mat(p + "ffn_up_exps.weight", Fe, d, et, E)
        mat(p + "ffn_down_exps.weight", d, Fe, et, E)
        mat(p + "ffn_gate_shexp.weight", Fe, d, lin)
        mat(p + "ffn_up_shexp.weight", Fe, d, lin)
        mat(p + "ffn_down_shexp.weight", d, Fe, lin)
