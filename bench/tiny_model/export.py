"""Write a trained embedded model as a qwen3 GGUF (Q8_0 matrices, f32 norms) with its tokenizer."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from model import Size

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_gguf(
    path: str, name: str, size: Size, params: dict, vocab: dict, context: int = 2048
) -> None:
    """Args: vocab: dict(tokens, types, merges, eos_id) from train.build_vocab."""
    s = size
    w = GGUFWriter(path, "qwen3")
    w.add_name(name)
    w.add_block_count(s.layers)
    w.add_context_length(context)
    w.add_embedding_length(s.d)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["eos_id"])
    w.add_eos_token_id(vocab["eos_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def mat(name, x):  # x: numpy order [out, in]
        w.add_tensor(
            name,
            quantize(np.ascontiguousarray(x, np.float32), GGMLQuantizationType.Q8_0),
            raw_dtype=GGMLQuantizationType.Q8_0,
        )

    def vec(name, x):
        w.add_tensor(name, np.asarray(x, np.float32))

    p = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    mat("token_embd.weight", p["embed"])
    vec("output_norm.weight", p["final_norm"])
    for i, lp in enumerate(params["layers"]):
        lp = {k: np.asarray(v) for k, v in lp.items()}
        g = f"blk.{i}."
        for ours, theirs in (
            ("wq", "attn_q"),
            ("wk", "attn_k"),
            ("wv", "attn_v"),
            ("wo", "attn_output"),
            ("wg", "ffn_gate"),
            ("wu", "ffn_up"),
            ("wd", "ffn_down"),
        ):
            mat(g + theirs + ".weight", lp[ours].T)  # ours are [in, out]
        vec(g + "attn_norm.weight", lp["attn_norm"])
        vec(g + "ffn_norm.weight", lp["ffn_norm"])
        vec(g + "attn_q_norm.weight", lp["q_norm"])
        vec(g + "attn_k_norm.weight", lp["k_norm"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
