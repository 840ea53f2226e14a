"""Random-weight GGUFs at real model shapes, with a real tokenizer copied from a vocab GGUF.

Speed does not depend on weight values, so benchmarks run on these files; their text is
meaningless. Rows are drawn from a small random pool and tiled, and tensors of one shape are
shared by all layers, so an 8B file is written in seconds and a 30B one in little memory.
K-quant and IQ4_XS matrices are random block bytes with small finite scales (gguf-py cannot
quantize to them), and `--type q4_k_m` mixes Q4_K and Q6_K as llama.cpp's Q4_K_M does.

    python bench/make_model.py --shape qwen3-8b --type bf16 \
        --vocab ../shared/fixtures/tokenizers/ggml-vocab-qwen2.gguf --out qwen3-8b-bf16.gguf

DeepSeek V4 shapes (deepseek4-flash, deepseek4-small) are bench/make_deepseek4.py's, `--type`
their experts' (mxfp4, q2_k, q4_k, bf16); `--layers N` writes the first N blocks of any shape.
"""

from __future__ import annotations

import argparse
import logging
import time

import make_deepseek4
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from luce_jax.loading.gguf import GGUFFile

log = logging.getLogger("make_model")

# d_model, layers, heads, kv heads, head dim, ffn, tied embeddings; MoE: experts E, used k,
# expert ffn Fe (architecture qwen3moe, every layer MoE, no shared expert).
SHAPES = {
    "qwen3-0.6b": dict(d=1024, L=28, H=16, K=8, D=128, F=3072, tied=True),
    "qwen3-8b": dict(d=4096, L=36, H=32, K=8, D=128, F=12288, tied=False),
    "qwen3-32b": dict(d=5120, L=64, H=64, K=8, D=128, F=25600, tied=False),
    "qwen3-30b-a3b": dict(d=2048, L=48, H=32, K=4, D=128, F=6144, tied=False, E=128, k=8, Fe=768),
    # Hybrid (architecture qwen35): every 4th layer gated full attention (rotary on a quarter of
    # D), the others Gated DeltaNet with Hk key and Hv value heads of Dk = Dv = 128, conv 4.
    "qwen35-27b": dict(d=5120, L=64, H=24, K=4, D=256, F=17408, tied=False, Hk=16, Hv=48),
    # a small one for correctness checks on the GPU (bench/kernels/backend_tokens.py)
    "qwen35-small": dict(d=1024, L=8, H=8, K=2, D=128, F=2048, tied=False, Hk=4, Hv=8),
    # and its MoE form (qwen35moe): E experts, k per token, and a shared expert of Fs
    "qwen35moe-35b-a3b": dict(
        d=2048, L=40, H=16, K=2, D=256, F=512, tied=False, Hk=16, Hv=32, E=256, k=8, Fe=512, Fs=512
    ),
}
T = GGMLQuantizationType
F32 = T.F32
# --type: one GGML type for every matrix, or "q4_k_m", llama.cpp's Q4_K_M mix (`mix_type`).
TYPES = {
    "bf16": T.BF16,
    "f16": T.F16,
    "q8_0": T.Q8_0,
    "q4_0": T.Q4_0,
    "q4_k": T.Q4_K,
    "q5_k": T.Q5_K,
    "q6_k": T.Q6_K,
    "iq4_xs": T.IQ4_XS,
    "q5_0": T.Q5_0,  # kept by no kernel: loaders unpack it (llama.cpp's fallback type)
    "q4_1": T.Q4_1,
    "q4_k_m": None,
}
# Types gguf-py cannot quantize are written as random block bytes with their f16 scale
# fields set to small finite values (byte offset in the block, magnitude), so the values stay
# about the size of the others' (0.02) and every loader reads the same valid file.
RANDOM_SCALES = {
    T.Q2_K: ((80, 2e-5), (82, 2e-5)),
    T.Q4_K: ((0, 2e-5), (2, 2e-5)),
    T.Q5_K: ((0, 1e-5), (2, 1e-5)),
    T.Q6_K: ((208, 5e-6),),
    T.IQ4_XS: ((0, 5e-6),),
}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that keep more bits in its _M mixes."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def mix_type(name: str, layer: int | None, n_layers: int):
    """The type llama.cpp's quantizer gives a matrix in a Q4_K_M file: Q6_K for the output
    head, and for attn_v and ffn_down (experts too) in the layers use_more_bits picks; Q4_K
    for the rest."""
    if name == "output.weight":
        return T.Q6_K
    more = layer is not None and use_more_bits(layer, n_layers)
    if more and (".attn_v." in name or ".ffn_down" in name):
        return T.Q6_K
    return T.Q4_K


def random_rows(rows: int, cols: int, qtype, rng, pool: int = 64) -> np.ndarray:
    """[rows, bytes per row] uint8 of `qtype`, tiled from `pool` random rows."""
    if qtype in RANDOM_SCALES:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (pool * cols // block, size), dtype=np.uint8)
        for off, mag in RANDOM_SCALES[qtype]:
            d = (np.abs(rng.standard_normal(len(raw))) * mag).astype(np.float16)
            raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
        packed = raw.reshape(pool, -1)
    else:
        x = (rng.standard_normal((pool, cols)) * 0.02).astype(np.float32)
        if qtype == T.F16:
            packed = x.astype(np.float16).view(np.uint8)
        elif qtype == F32:
            packed = x.view(np.uint8)
        else:
            packed = quantize(x, qtype)
    reps = -(-rows // pool)
    return np.tile(packed, (reps, 1))[:rows]


def add_tokenizer(w: GGUFWriter, md: dict) -> None:
    """The vocabulary GGUF's tokenizer and chat template, copied."""
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md.get("tokenizer.ggml.pre", "qwen2"))
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_bos_token_id(md.get("tokenizer.ggml.bos_token_id", md["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(False)
    if "tokenizer.chat_template" in md:
        w.add_chat_template(md["tokenizer.chat_template"])


def write_deepseek4(shape: str, type_name: str, md: dict, out: str, rng, layers: int) -> None:
    """A deepseek4 file (make_deepseek4.py): its experts in type_name."""
    s = make_deepseek4.SHAPES[shape]
    if type_name not in make_deepseek4.EXPERT_TYPES:
        raise ValueError(f"--type {type_name}: {shape} takes {sorted(make_deepseek4.EXPERT_TYPES)}")
    n = min(layers or s["L"], s["L"])
    V = len(md["tokenizer.ggml.tokens"])
    w = GGUFWriter(out, make_deepseek4.ARCH)
    w.add_name(f"random {shape} {type_name}" + (f", first {n} layers" if n < s["L"] else ""))
    make_deepseek4.keys(w, s, n)
    add_tokenizer(w, md)
    drawn = {}

    def mat(name, rows, cols, qtype, experts=0):
        key = (rows, cols, experts, qtype)
        if key not in drawn:
            data = random_rows(max(experts, 1) * rows, cols, qtype, rng)
            drawn[key] = data.reshape(experts, rows, -1) if experts else data
        w.add_tensor(name, drawn[key], raw_dtype=qtype)

    make_deepseek4.tensors(w, s, n, V, type_name, mat, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def write(shape: str, type_name: str, vocab_path: str, out: str, seed: int = 0,
          layers: int = 0, mtp: bool = False) -> None:  # fmt: skip
    """Write shape's random model in type_name (layers: only the first N blocks; 0: all; mtp:
    a hybrid shape with an MTP block after the last, as llama.cpp's converter writes
    Qwen3.5's)."""
    rng = np.random.default_rng(seed)
    md = GGUFFile(vocab_path).metadata
    if shape in make_deepseek4.SHAPES:
        return write_deepseek4(shape, type_name, md, out, rng, layers)
    s, fixed = SHAPES[shape], TYPES[type_name]
    if layers:
        s = {**s, "L": min(layers, s["L"])}
    tokens = md["tokenizer.ggml.tokens"]
    V = len(tokens)
    moe, hybrid = "E" in s, "Hv" in s
    arch = ("qwen35" if hybrid else "qwen3") + ("moe" if moe else "")
    w = GGUFWriter(out, arch)
    w.add_name(f"random {shape} {type_name}")
    mtp = mtp and hybrid
    w.add_block_count(s["L"] + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(40960)
    w.add_embedding_length(s["d"])
    w.add_feed_forward_length(s["F"])
    w.add_head_count(s["H"])
    w.add_head_count_kv(s["K"])
    w.add_key_length(s["D"])
    w.add_value_length(s["D"])
    if moe:
        w.add_expert_count(s["E"])
        w.add_expert_used_count(s["k"])
        w.add_expert_feed_forward_length(s["Fe"])
        if "Fs" in s:
            w.add_expert_shared_feed_forward_length(s["Fs"])
    if hybrid:
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(128)
        w.add_ssm_group_count(s["Hk"])
        w.add_ssm_time_step_rank(s["Hv"])
        w.add_ssm_inner_size(128 * s["Hv"])
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(s["D"] // 4)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    add_tokenizer(w, md)

    # One draw per distinct tensor shape, shared by every layer: the writer holds its arrays
    # until the file is written, so a 61 GB file needs one layer's worth of memory, not 61 GB.
    drawn = {}

    def mat(name, rows, cols, experts=0, pool=64, layer=None):
        qtype = fixed if fixed is not None else mix_type(name, layer, s["L"])
        key = (rows, cols, experts, qtype)
        if key not in drawn:
            data = random_rows(max(experts, 1) * rows, cols, qtype, rng, pool)
            drawn[key] = data.reshape(experts, rows, -1) if experts else data
        w.add_tensor(name, drawn[key], raw_dtype=qtype)

    def norm(name, n):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    d, H, K, D, F = s["d"], s["H"], s["K"], s["D"], s["F"]
    # Every token its own embedding and every layer its own router rows, so that routing
    # spreads over the experts as a trained router's does (a tiled pool made tokens share
    # embeddings and experts share router rows, and routing collapsed onto a few experts).
    mat("token_embd.weight", V, d, pool=V)
    norm("output_norm.weight", d)
    if not s["tied"]:
        mat("output.weight", V, d)

    def ffn(p: str, i: int) -> None:
        if not moe:
            mat(p + "ffn_gate.weight", F, d, layer=i)
            mat(p + "ffn_up.weight", F, d, layer=i)
            mat(p + "ffn_down.weight", d, F, layer=i)
            return
        E, Fe = s["E"], s["Fe"]
        router = random_rows(E, d, F32, rng, pool=E).view(np.float32)
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        mat(p + "ffn_gate_exps.weight", Fe, d, E, layer=i)
        mat(p + "ffn_up_exps.weight", Fe, d, E, layer=i)
        mat(p + "ffn_down_exps.weight", d, Fe, E, layer=i)
        if "Fs" in s:  # the shared expert and its gate
            # GGUF [d, 1], as llama.cpp's converter writes it
            gate = 0.02 * rng.standard_normal((1, d), np.float32)
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", gate)
            mat(p + "ffn_gate_shexp.weight", s["Fs"], d, layer=i)
            mat(p + "ffn_up_shexp.weight", s["Fs"], d, layer=i)
            mat(p + "ffn_down_shexp.weight", d, s["Fs"], layer=i)

    for i in range(s["L"]):
        p = f"blk.{i}."
        if hybrid:
            hybrid_layer(s, i, mat, norm, w, rng)
            ffn(p, i)
            continue
        mat(p + "attn_q.weight", H * D, d, layer=i)
        mat(p + "attn_k.weight", K * D, d, layer=i)
        mat(p + "attn_v.weight", K * D, d, layer=i)
        mat(p + "attn_output.weight", d, H * D, layer=i)
        norm(p + "attn_q_norm.weight", D)
        norm(p + "attn_k_norm.weight", D)
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        ffn(p, i)
    if mtp:  # a gated attention block and the nextn input projection and norms
        p = f"blk.{s['L']}."
        norm(p + "attn_norm.weight", d)
        norm(p + "post_attention_norm.weight", d)
        gated_attention(s, p, mat, norm, None)
        ffn(p, None)
        mat(p + "nextn.eh_proj.weight", d, 2 * d)
        for x in ("enorm", "hnorm", "shared_head_norm"):
            norm(p + f"nextn.{x}.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def hybrid_layer(s: dict, i: int, mat, norm, w, rng) -> None:
    """The norms and mixer of one qwen35 layer under llama.cpp's names (its FFN is written
    apart): gated full attention every 4th layer (query and gate rows together), else Gated
    DeltaNet; the small ssm tensors stay F32 as in llama.cpp's quantized files."""
    p, d = f"blk.{i}.", s["d"]
    norm(p + "attn_norm.weight", d)
    norm(p + "post_attention_norm.weight", d)
    if (i + 1) % 4 == 0:
        gated_attention(s, p, mat, norm, i)
        return
    Hk, Hv, Dh = s["Hk"], s["Hv"], 128
    C = 2 * Hk * Dh + Hv * Dh
    mat(p + "attn_qkv.weight", C, d, layer=i)
    mat(p + "attn_gate.weight", Hv * Dh, d, layer=i)
    mat(p + "ssm_beta.weight", Hv, d, layer=i)
    mat(p + "ssm_alpha.weight", Hv, d, layer=i)
    mat(p + "ssm_out.weight", d, Hv * Dh, layer=i)
    w.add_tensor(p + "ssm_conv1d.weight", (0.2 * rng.standard_normal((C, 4))).astype(np.float32))
    w.add_tensor(p + "ssm_dt.bias", rng.standard_normal(Hv).astype(np.float32))
    w.add_tensor(p + "ssm_a", -rng.uniform(0.1, 1.0, Hv).astype(np.float32))
    norm(p + "ssm_norm.weight", Dh)


def gated_attention(s: dict, p: str, mat, norm, i) -> None:
    """A qwen35 full-attention mixer's tensors (query and gate rows together)."""
    d, H, K, D = s["d"], s["H"], s["K"], s["D"]
    mat(p + "attn_q.weight", 2 * H * D, d, layer=i)
    mat(p + "attn_k.weight", K * D, d, layer=i)
    mat(p + "attn_v.weight", K * D, d, layer=i)
    mat(p + "attn_output.weight", d, H * D, layer=i)
    norm(p + "attn_q_norm.weight", D)
    norm(p + "attn_k_norm.weight", D)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(make_deepseek4.SHAPES),
                    required=True)  # fmt: skip
    ap.add_argument("--type", choices=sorted({*TYPES, *make_deepseek4.EXPERT_TYPES}),
                    default="bf16", help="deepseek4 shapes: the routed experts' type")  # fmt: skip
    ap.add_argument("--layers", type=int, default=0,
                    help="write only the first N blocks, at full width (0: all)")  # fmt: skip
    ap.add_argument("--vocab", required=True, help="a GGUF whose tokenizer is copied")
    ap.add_argument("--mtp", action="store_true", help="hybrid shapes: with an MTP block")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    t = time.time()
    write(a.shape, a.type, a.vocab, a.out, a.seed, a.layers, a.mtp)
    log.info("wrote %s in %.1f s", a.out, time.time() - t)


if __name__ == "__main__":
    main()
