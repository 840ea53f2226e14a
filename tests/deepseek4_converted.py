"""A tiny random DeepSeek V4 model made into a GGUF file by llama.cpp's own converter, with the
transformers reference the tests hold it to.

transformers 5.25 cannot save a deepseek_v4 model in a layout the converter reads
(../shared/reference/deepseek4.md, 11.8), so the model is built in transformers, its weights
renamed into the original checkpoint's layout (`ORIGINAL`, the inverse of transformers'
conversion_mapping "deepseek_v4"), its routed experts packed as FP4 with e8m0 scales (rounded
onto that grid first, so the converter's MXFP4 holds exactly the values transformers computes
with) and its config given the original keys (compress_ratios, num_hash_layers, ...).

The shape keeps the real model's ratios (CSA 4, HCA 128, 4 hyper-connection streams) at width
64, with a 16-token window, 16 indexer heads (top-k ties would make the indexer's choice the
implementation's), YaRN on the compressed layers and the Qwen2 vocabulary. The prompt is longer
than the window and than an HCA block, and its greedy tokens cross the next HCA block's end.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np

import converted
import llama_cpp

HERE = Path(__file__).resolve().parent
PROMPT_LEN, GREEDY = 250, 16  # position 255 closes HCA entry 1 while decoding
RATIOS = [0, 4, 128, 4, 128, 0]
CONFIG = dict(
    hidden_size=64, num_hidden_layers=len(RATIOS), num_attention_heads=4, num_key_value_heads=1,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    sliding_window=16, index_n_heads=16, index_head_dim=32, index_topk=4, n_routed_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, num_hash_layers=2,
    compress_ratios=RATIOS, compress_rope_theta=160000.0, rope_theta=10000.0,
    max_position_embeddings=4096, swiglu_limit=1.5, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, rms_norm_eps=1e-6, routed_scaling_factor=1.5, norm_topk_prob=True,
    scoring_func="sqrtsoftplus", tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                  "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip
SEED = 0
REVISION = 1  # raise when a change here changes the files or references

# transformers' parameter names (after model.layers.N.) -> the original checkpoint's (after
# layers.N.)
ORIGINAL = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
ROOT = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _key() -> str:
    h = hashlib.sha256((HERE / "deepseek4_converted.py").read_bytes())
    h.update(repr((REVISION, converted.SPECIALS["qwen2"])).encode())
    return h.hexdigest()[:12]


def folder() -> Path:
    d = llama_cpp.cache() / f"deepseek4-{_key()}"
    d.mkdir(exist_ok=True)
    return d


def to_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [rows, cols] float32 rounded onto the MXFP4 grid: (its values, the packed codes uint8
    [rows, cols / 2] (element 2i in the low nibble), the e8m0 scales uint8 [rows, cols / 32])."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    top = np.maximum(np.abs(g).max(-1), 1e-30)
    exp = np.ceil(np.log2(top / 6.0)).astype(np.int32)  # the largest value maps to <= 6
    x = g / np.exp2(exp)[..., None]
    idx = np.abs(np.abs(x)[..., None] - E2M1).argmin(-1)
    code = (idx | (np.signbit(x) & (idx > 0)) * 8).astype(np.uint8).reshape(rows, cols)
    values = (np.where(code & 8, -1, 1) * E2M1[code & 7]).reshape(rows, cols // 32, 32)
    values = (values * np.exp2(exp)[..., None]).reshape(rows, cols).astype(np.float32)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return values, packed.astype(np.uint8), (exp + 127).astype(np.uint8)


def hf_model():
    """The transformers model (float32, eval): random weights at scales that keep every part
    of the block in play, experts already on the MXFP4 grid."""
    import torch
    from tokenizers import Tokenizer
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    tok = Tokenizer.from_file(str(converted.tokenizer_dir("qwen2") / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    cfg = DeepseekV4Config(vocab_size=vocab, eos_token_id=tok.token_to_id("<|im_end|>"),
                           bos_token_id=None, **CONFIG)  # fmt: skip
    torch.manual_seed(SEED)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("tid2eid"):
                continue
            if p.ndim == 1 or name.endswith(("scale", "sinks", "base", "position_bias")):
                std, mean = 0.3, (1.0 if "norm" in name else 0.0)
            else:
                std, mean = p.shape[-1] ** -0.5, 0.0
            p.copy_(mean + std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.argsort(torch.rand(vocab, E, generator=g), dim=1)[:, :k])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for p in (ex.gate_up_proj, ex.down_proj):
                flat = p.detach().numpy().reshape(-1, p.shape[-1])
                p.copy_(torch.from_numpy(to_fp4(flat)[0].reshape(p.shape)))
    return model


def _original_state(model) -> dict:
    """The model's tensors under the original checkpoint's names, experts as FP4 and scales."""
    import torch

    out = {}
    for name, t in model.state_dict().items():
        if name in ROOT:
            out[ROOT[name]] = t
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if m is None:
            if "rotary_emb" in name:
                continue
            raise KeyError(name)
        i, rest = m.groups()
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            arr = t.numpy()
            F = arr.shape[1] // 2
            for e in range(arr.shape[0]):
                parts = ({"w2": arr[e]} if rest.endswith("down_proj")
                         else {"w1": arr[e, :F], "w3": arr[e, F:]})  # fmt: skip
                for w, x in parts.items():
                    _, packed, scale = to_fp4(np.ascontiguousarray(x))
                    p = f"layers.{i}.ffn.experts.{e}.{w}."
                    out[p + "weight"] = torch.from_numpy(packed.view(np.int8).copy())
                    out[p + "scale"] = torch.from_numpy(scale.copy())
            continue
        if rest not in ORIGINAL:
            if "rotary_emb" in rest:
                continue
            raise KeyError(name)
        out[f"layers.{i}.{ORIGINAL[rest]}"] = t
    return {k: v.contiguous() for k, v in out.items()}


def checkpoint() -> Path:
    """The model in the original checkpoint layout: model.safetensors, config.json, tokenizer."""
    d = folder() / "original"
    with llama_cpp.locked("deepseek4-" + d.name):
        if (d / "done").is_file():
            return d
        from safetensors.torch import save_file

        model = hf_model()
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        save_file(_original_state(model), str(d / "model.safetensors"))
        cfg = {**CONFIG, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
               "vocab_size": model.config.vocab_size, "eos_token_id": model.config.eos_token_id,
               "torch_dtype": "float32"}  # fmt: skip
        (d / "config.json").write_text(json.dumps(cfg))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(converted.tokenizer_dir("qwen2") / f, d / f)
        (d / "done").write_text("")
    return d


def gguf() -> Path:
    """The model converted by convert_hf_to_gguf.py (float32 but for the MXFP4 experts)."""
    out = folder() / "deepseek4-f32.gguf"
    with llama_cpp.locked("deepseek4-gguf"):  # one worker makes it, the other waits
        if not out.is_file():
            path = checkpoint()
            llama_cpp.convert(path, out)
            shutil.rmtree(path, ignore_errors=True)
    return out


def reference() -> dict:
    """transformers on the model: a PROMPT_LEN prompt, GREEDY greedy tokens after it, and the
    float32 logits of the prompt's last position and of each greedy step ([GREEDY + 1, V])."""
    out = folder() / "deepseek4-reference.npz"
    return converted.greedy_reference(out, hf_model, SEED, PROMPT_LEN, GREEDY)


if __name__ == "__main__":  # make the file and reference ahead of the suite
    print(gguf(), reference()["logits"].shape, flush=True)
