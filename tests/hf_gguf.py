"""Tiny random HF transformers models written as GGUF, the way llama.cpp's converter does."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

from luce_jax.loading.tokenizer import _byte_chars as byte_tokens

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_vocab(size: int):
    """Byte-level BPE vocabulary: 256 bytes, a few merges, ChatML specials, unused padding."""
    tokens = byte_tokens()
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    while len(tokens) < size:
        tokens.append(f"<|unused{len(tokens)}|>")
        types.append(5)
    return tokens, types, merges


def make_hf_model(
    arch: str,
    seed: int = 0,
    vocab: int = 320,
    tie: bool | None = None,
    rope_scaling: dict | None = None,
    width: int = 64,
    ffn: int = 96,
    special: tuple[int | None, int] | None = None,
    norm_topk: bool = True,
    linear_v_dim: int = 16,
):
    """A small random-weight HF model of `arch` (llama, qwen2, qwen3, qwen3moe, qwen35,
    qwen35moe), float32: `width` wide with FFNs (experts, a shared expert) `ffn` wide or half
    that; `special`: its (bos, eos) ids (default: the tiny vocabulary's); `linear_v_dim`: a
    Gated DeltaNet value head's width."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=vocab - 1 if special is None else special[0],
        eos_token_id=256 + 6 if special is None else special[1],
    )
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=ffn // 2)
    if arch == "llama":
        cfg = LlamaConfig(
            **common, rope_theta=10000.0, tie_word_embeddings=bool(tie), rope_scaling=rope_scaling
        )
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        tied = True if tie is None else tie
        cfg = Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=bool(tie))
        model = Qwen3ForCausalLM(cfg)
    elif arch == "qwen3moe":  # 8 experts, 2 per token, renormalized as Qwen3-30B-A3B does
        cfg = Qwen3MoeConfig(
            **common,
            head_dim=32,
            rope_theta=1e6,
            tie_word_embeddings=bool(tie),
            **experts,
            norm_topk_prob=norm_topk,
        )
        model = Qwen3MoeForCausalLM(cfg)
    elif arch in ("qwen35", "qwen35moe"):  # layers 0-2 Gated DeltaNet, 3 full attention
        from transformers import (
            Qwen3_5ForCausalLM,
            Qwen3_5MoeForCausalLM,
            Qwen3_5MoeTextConfig,
            Qwen3_5TextConfig,
        )

        moe = arch == "qwen35moe"  # 8 experts, 2 per token, and a gated shared expert
        extra = dict(experts, shared_expert_intermediate_size=ffn * 5 // 12)  # 40 at 96
        cfg = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(
            **{**common, "num_hidden_layers": 4},
            **(extra if moe else {}),
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=linear_v_dim,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=bool(tie),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
            },
        )
        model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # default init is tiny; widen it so differences would show
        for name, p in model.named_parameters():
            if name.endswith(".A_log"):  # decays exp(-A * softplus(.)) well inside (0, 1)
                p.copy_(torch.log(torch.rand_like(p) * 0.5 + 0.1))
            elif "norm" in name and arch.startswith("qwen35") and "linear_attn" not in name:
                p.copy_(0.1 * torch.randn_like(p))  # zero-centred: the scale is 1 + w
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of llama Q/K rows (halves -> pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def v_tiled(x: np.ndarray, axis: int, n_k: int, per_k: int, dim: int) -> np.ndarray:
    """llama.cpp's converter reorders linear-attention V heads from grouped by K head
    [K0v0, K0v1, K1v0, K1v1] to tiled [K0v0, K1v0, K0v1, K1v1] along `axis`."""
    x = np.moveaxis(x, axis, 0)
    shape = x.shape
    x = x.reshape(n_k, per_k, dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(x, 0, axis)


def hf_to_gguf(model, arch: str, path, qtype=GGMLQuantizationType.F32, chat_template=CHATML,
               mtp: bool = False):  # fmt: skip
    """Write `model` (HF, float32) as a GGUF file with a tiny byte-level vocabulary; `mtp`
    (qwen35 archs): with a random MTP block after the last, as llama.cpp's converter writes
    Qwen3.5's (blk.N.nextn.*, nextn_predict_layers)."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    if arch.startswith("qwen35"):  # Qwen3.5 norms scale by 1 + w; the converter stores 1 + w
        for k in sd:
            if k.endswith("norm.weight") and "linear_attn" not in k:
                sd[k] = sd[k] + 1
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch in ("qwen3moe", "qwen35moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(getattr(cfg, "norm_topk_prob", True))
    if arch == "qwen35moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch.startswith("qwen35"):
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_rope_dimension_sections([*cfg.rope_parameters["mrope_section"], 0])
    if cfg.rope_parameters.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_parameters["factor"]))
    tokens, types, merges = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    def put(name, x, quant=True):
        x = np.ascontiguousarray(x, np.float32)
        if quant and x.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, x)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        if arch.startswith("qwen35"):
            _qwen35_layer(cfg, sd, p, g, put)
            continue
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, H), _permute(k, K)
        put(g + "attn_q.weight", q)
        put(g + "attn_k.weight", k)
        put(g + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(g + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        for x in "qkv":
            if p + f"self_attn.{x}_proj.bias" in sd:
                put(g + f"attn_{x}.bias", sd[p + f"self_attn.{x}_proj.bias"])
        if arch in ("qwen3", "qwen3moe"):
            put(g + "attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            put(g + "attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        put(g + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(g + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        if arch == "qwen3moe":  # experts stacked [E, out, in], as llama.cpp's converter writes
            F = cfg.moe_intermediate_size
            gate_up = sd[p + "mlp.experts.gate_up_proj"]
            put(g + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
            put(g + "ffn_gate_exps.weight", gate_up[:, :F])
            put(g + "ffn_up_exps.weight", gate_up[:, F:])
            put(g + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
            continue
        put(g + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(g + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(g + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    if mtp:
        _mtp_block(cfg, sd, put)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _mtp_block(cfg, sd, put) -> None:
    """A random MTP block as blk.N (N the model's blocks): a full-attention layer's tensors
    (the model's first one's, with noise) and the nextn input projection and norms."""
    rng = np.random.default_rng(11)
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    i = cfg.layer_types.index("full_attention")
    p, g = f"model.layers.{i}.", f"blk.{i}."
    noisy = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) if k.startswith(p) else v
             for k, v in sd.items()}  # fmt: skip
    _qwen35_layer(cfg, noisy, p, g, lambda name, x, q=True: put(name.replace(g, f"blk.{n}.", 1),
                                                                 x, q))  # fmt: skip
    put(f"blk.{n}.nextn.eh_proj.weight", rng.normal(0, 0.1, (d, 2 * d)))
    for x in ("enorm", "hnorm", "shared_head_norm"):
        put(f"blk.{n}.nextn.{x}.weight", 1 + rng.normal(0, 0.1, d))


def _qwen35_layer(cfg, sd, p: str, g: str, put) -> None:
    """One Qwen3.5 layer under llama.cpp's tensor names (conversion/qwen.py, 11434): full
    attention keeps q_proj's interleaved query|gate rows; a Gated DeltaNet layer gets
    attn_qkv, attn_gate, ssm_* with V heads tiled, ssm_a = -exp(A_log)."""
    put(g + "attn_norm.weight", sd[p + "input_layernorm.weight"])
    put(g + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
    if p + "mlp.gate.weight" in sd:  # qwen35moe: experts [E, out, in], then the shared expert
        F = cfg.moe_intermediate_size
        gate_up = sd[p + "mlp.experts.gate_up_proj"]
        put(g + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        put(g + "ffn_gate_exps.weight", gate_up[:, :F])
        put(g + "ffn_up_exps.weight", gate_up[:, F:])
        put(g + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
        put(g + "ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"])  # [1, d]
        for x in ("gate", "up", "down"):
            put(g + f"ffn_{x}_shexp.weight", sd[p + f"mlp.shared_expert.{x}_proj.weight"])
    else:
        for x in ("gate", "up", "down"):
            put(g + f"ffn_{x}.weight", sd[p + f"mlp.{x}_proj.weight"])
    if cfg.layer_types[int(g.split(".")[1])] == "full_attention":
        a = p + "self_attn."
        for x, y in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            put(g + f"attn_{x}.weight", sd[a + f"{y}_proj.weight"])
        put(g + "attn_q_norm.weight", sd[a + "q_norm.weight"])
        put(g + "attn_k_norm.weight", sd[a + "k_norm.weight"])
        return
    a = p + "linear_attn."
    n_k, n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def tile(x, axis, dim):
        return v_tiled(x, axis, n_k, n_v // n_k, dim)

    qkv = sd[a + "in_proj_qkv.weight"]
    qk = 2 * n_k * dk
    put(g + "attn_qkv.weight", np.concatenate([qkv[:qk], tile(qkv[qk:], 0, dv)]))
    put(g + "attn_gate.weight", tile(sd[a + "in_proj_z.weight"], 0, dv))
    conv = sd[a + "conv1d.weight"][:, 0]  # [channels, kernel]
    # the convolution's 4 taps a row, and beta and alpha, stay float in a quantized file: the
    # layer's input projection then fuses into a quantized part and float ones
    put(g + "ssm_conv1d.weight", np.concatenate([conv[:qk], tile(conv[qk:], 0, dv)]), False)
    put(g + "ssm_dt.bias", tile(sd[a + "dt_bias"], 0, 1))
    put(g + "ssm_a", tile(-np.exp(sd[a + "A_log"]), 0, 1))
    put(g + "ssm_beta.weight", tile(sd[a + "in_proj_b.weight"], 0, 1), False)
    put(g + "ssm_alpha.weight", tile(sd[a + "in_proj_a.weight"], 0, 1), False)
    put(g + "ssm_norm.weight", sd[a + "norm.weight"])
    put(g + "ssm_out.weight", tile(sd[a + "out_proj.weight"], 1, dv))
