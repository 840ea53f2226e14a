"""A DFlash block drafter (z-lab's DFlash; llama.cpp's `dflash` architecture, src/models/
dflash.cpp): a few decoder layers that draft a whole block of tokens in one forward pass,
conditioned on the target's hidden states.

Context: at each position p the target fed, its residual streams at the drafter's
`target_layers` (llama.cpp's layer-output ids: L is the stream before block L) are
concatenated, projected by `fc` and normed (`enc_norm`) to g_p; each draft layer's own k and v
projections of g_p (k normed and roped at p) are that layer's K/V at p. The drafter's KV cache
holds these context rows only.

Block: [t, MASK x (B - 1)] at positions p0 .. p0 + B - 1, where t is the token at p0 the
target emitted last: the target's embeddings, then per layer attention with q, k and v from
the block itself (q and k normed and roped) over the context rows before p0 and the whole block
(no causal mask inside the block), and a SwiGLU FFN, both residual; the final norm and the
target's lm_head give the logits at block index i, the proposal for position p0 + i.

The GGUF is the one llama.cpp reads: general.architecture "dflash", `dflash.block_size`,
`dflash.target_layers`, `tokenizer.ggml.mask_token_id`, the Qwen3 keys, `fc.weight`,
`enc.output_norm.weight`, `output_norm.weight` and Qwen3's layer tensors; the embedding and
lm_head are the target's. DFlash2's convolutions and selector and DSpark's heads are not read
(such files are refused).

Shapes: T tokens, n target layers read, d width, H / K heads / kv heads, D head dim, B block.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .dense import apply_rope, rms_norm, rope_tables, write_and_attend

ARCH = "dflash"
LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "ffn_norm", "wg", "wu", "wd")
_FILE = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
         "wo": "attn_output", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
         "ffn_norm": "ffn_norm", "wg": "ffn_gate", "wu": "ffn_up", "wd": "ffn_down"}  # fmt: skip
_REFUSED = ("selector_hidden.weight", "markov_w1.weight", "d2t")  # DFlash2, DSpark


@dataclass(frozen=True)
class DFlashConfig:
    d: int
    layers: int
    heads: int  # H
    kv_heads: int  # K
    head_dim: int  # D
    ffn: int
    eps: float
    rope_base: float
    block_size: int  # B the drafter was trained with
    target_layers: tuple[int, ...]  # layer-output ids of the target it reads
    mask_token: int

    @property
    def rope(self) -> ModelConfig:
        """A ModelConfig for dense.rope_tables / apply_rope (NeoX rope over the head)."""
        c = (self.d, self.layers, self.heads, self.kv_heads, self.head_dim, self.ffn)
        return ModelConfig("dflash", 0, *c, self.eps, self.rope_base, self.head_dim)


def init(cfg: DFlashConfig, key, scale: float = 0.02) -> dict:
    """Random params: matrices [in, out] float32, norms ones."""
    d, H, K, D, F = cfg.d, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn
    shapes = {"wq": (d, H * D), "wk": (d, K * D), "wv": (d, K * D), "wo": (H * D, d),
              "wg": (d, F), "wu": (d, F), "wd": (F, d)}  # fmt: skip
    keys = iter(jax.random.split(key, 1 + cfg.layers * len(shapes)))

    def w(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    layers = []
    for _ in range(cfg.layers):
        lp = {n: w(s) for n, s in shapes.items()}
        lp.update(attn_norm=jnp.ones(d), ffn_norm=jnp.ones(d), q_norm=jnp.ones(D),
                  k_norm=jnp.ones(D))  # fmt: skip
        layers.append(lp)
    n = len(cfg.target_layers)
    return {"fc": w((n * d, d)), "enc_norm": jnp.ones(d), "final_norm": jnp.ones(d),
            "layers": layers}  # fmt: skip


def _mm(x, w):
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def context_kv(p: dict, cfg: DFlashConfig, features, positions) -> list:
    """Each layer's (k, v) [T, K, D] of the context rows: features float32 [T, n * d] (the
    target's streams at target_layers, concatenated), at positions [T]."""
    T, K, D = features.shape[0], cfg.kv_heads, cfg.head_dim
    g = rms_norm(_mm(features, p["fc"]), p["enc_norm"], cfg.eps)
    cos, sin = rope_tables(positions, cfg.rope)
    out = []
    for lp in p["layers"]:
        k = rms_norm(_mm(g, lp["wk"]).reshape(T, K, D), lp["k_norm"], cfg.eps)
        out.append((apply_rope(k, cos, sin, cfg.rope), _mm(g, lp["wv"]).reshape(T, K, D)))
    return out


def block(p: dict, cfg: DFlashConfig, x, positions, attend):
    """The block pass: x float32 [T, d] (the block tokens' embeddings) at positions [T];
    attend(li, q [T, H, D], k, v [T, K, D]) -> o [T, H, D]: layer li's attention over its
    context rows and the block (which it may write to a cache). Returns the final-normed
    [T, d] (for the target's lm_head)."""
    T, H, K, D = x.shape[0], cfg.heads, cfg.kv_heads, cfg.head_dim
    cos, sin = rope_tables(positions, cfg.rope)
    for li, lp in enumerate(p["layers"]):
        n = rms_norm(x, lp["attn_norm"], cfg.eps)
        q = rms_norm(_mm(n, lp["wq"]).reshape(T, H, D), lp["q_norm"], cfg.eps)
        k = rms_norm(_mm(n, lp["wk"]).reshape(T, K, D), lp["k_norm"], cfg.eps)
        v = _mm(n, lp["wv"]).reshape(T, K, D)
        q, k = apply_rope(q, cos, sin, cfg.rope), apply_rope(k, cos, sin, cfg.rope)
        x = x + _mm(attend(li, q, k, v).reshape(T, H * D), lp["wo"])
        n = rms_norm(x, lp["ffn_norm"], cfg.eps)
        x = x + _mm(jax.nn.silu(_mm(n, lp["wg"])) * _mm(n, lp["wu"]), lp["wd"])
    return rms_norm(x, p["final_norm"], cfg.eps)


def paged_attend(attention, caches: list, batch: dict, p: dict, cfg: DFlashConfig):
    """`block`'s attend over the drafter's paged caches [(k, v) per layer] with the paged
    attention kernel `attention` and a step batch (write_idx, positions for the mask, block
    tables, kv_lens, cu_q_lens, seg_ids): each layer writes its block K/V, then attends.
    `caches` is updated in place with each layer's new (k, v)."""

    def attend(li, q, k, v):
        kc, vc = caches[li]
        o, kc, vc = write_and_attend(attention, q, k, v, kc, vc, batch, cfg.head_dim**-0.5,
                                     p["layers"][li]["wq"])  # fmt: skip
        caches[li] = (kc, vc)
        return o

    return attend


def reference(p: dict, cfg: DFlashConfig, features, embed_table, token: int, length: int = 0):
    """The block's final-normed outputs [B, d] the plain way, for one sequence: context rows
    from features [n, n_t * d] at positions 0 .. n - 1, the block [token, MASK x (B - 1)] at
    n .. n + B - 1 (B: `length`, else the drafter's block size), each block query over every
    context row and every block row."""
    B, n = length or cfg.block_size, features.shape[0]
    ctx = context_kv(p, cfg, features, jnp.arange(n))
    toks = jnp.asarray([token] + [cfg.mask_token] * (B - 1))
    x = jnp.asarray(embed_table)[toks].astype(jnp.float32)
    groups = cfg.heads // cfg.kv_heads

    def attend(li, q, k, v):
        keys = jnp.repeat(jnp.concatenate([ctx[li][0], k]), groups, axis=1)  # [n + B, H, D]
        vals = jnp.repeat(jnp.concatenate([ctx[li][1], v]), groups, axis=1)
        w = jax.nn.softmax(jnp.einsum("thd,shd->hts", q, keys) * cfg.head_dim**-0.5, -1)
        return jnp.einsum("hts,shd->thd", w, vals)

    return block(p, cfg, x, n + jnp.arange(B), attend)


def load(path: str, d: int, n_layers: int, dtype) -> tuple[DFlashConfig, dict]:
    """A DFlash GGUF's config and params (matrices in `dtype`, norms float32), for a target of
    width d and n_layers blocks.

    Raises:
      ValueError: the file is no DFlash drafter, one this engine does not run (DFlash2,
        DSpark, a drafter with its own vocabulary), or one for another target.
    """
    from gguf.quants import dequantize

    from ..loading.gguf import GGUFFile

    f = GGUFFile(path)
    md = f.metadata

    def get(key):
        if f"{ARCH}.{key}" not in md:
            raise ValueError(f"draft={path!r}: missing {ARCH}.{key}")
        return md[f"{ARCH}.{key}"]

    arch = md.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"draft={path!r}: general.architecture is {arch!r}, not {ARCH!r}")
    for name in _REFUSED:
        if name in f.tensors:
            raise ValueError(f"draft={path!r}: has {name} (DFlash2 or DSpark); plain DFlash only")
    if "tokenizer.ggml.mask_token_id" not in md:
        raise ValueError(f"draft={path!r}: missing tokenizer.ggml.mask_token_id")
    heads = int(get("attention.head_count"))
    cfg = DFlashConfig(
        d=int(get("embedding_length")),
        layers=int(get("block_count")),
        heads=heads,
        kv_heads=int(get("attention.head_count_kv")),
        head_dim=int(md.get(f"{ARCH}.attention.key_length", int(get("embedding_length")) // heads)),
        ffn=int(get("feed_forward_length")),
        eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_base=float(md.get(f"{ARCH}.rope.freq_base", 10000.0)),
        block_size=int(md.get(f"{ARCH}.block_size", 16)),
        target_layers=tuple(int(x) for x in get("target_layers")),
        mask_token=int(md["tokenizer.ggml.mask_token_id"]),
    )
    if cfg.d != d or not all(0 < x <= n_layers for x in cfg.target_layers):
        raise ValueError(
            f"draft={path!r}: a drafter for width {cfg.d} reading layers {cfg.target_layers}; "
            f"the model has width {d} and {n_layers} layers"
        )
    if "output.weight" in f.tensors or "token_embd.weight" in f.tensors:
        raise ValueError(f"draft={path!r}: has its own embedding or lm_head; the target's are used")

    def t(name, mat):
        info = f.tensors[name]
        x = dequantize(np.asarray(f.raw(name)), info.qtype).reshape(info.shape)
        return jnp.asarray(x.T, dtype) if mat else jnp.asarray(x, jnp.float32)

    layers = []
    for i in range(cfg.layers):
        layers.append({ours: t(f"blk.{i}.{_FILE[ours]}.weight", ours[0] == "w") for ours in LAYER})
    params = {"fc": t("fc.weight", True), "enc_norm": t("enc.output_norm.weight", False),
              "final_norm": t("output_norm.weight", False), "layers": layers}  # fmt: skip
    return cfg, params


def save(path: str, cfg: DFlashConfig, params: dict, target_metadata: dict, name: str) -> None:
    """Write a drafter as llama.cpp's dflash GGUF: F16 matrices [out, in], F32 norms, the
    target's tokenizer (target_metadata's tokenizer.* keys) with the mask token."""
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(path, ARCH)
    w.add_name(name)
    w.add_block_count(cfg.layers)
    w.add_context_length(int(target_metadata.get("context_length", 4096)))
    w.add_embedding_length(cfg.d)
    w.add_feed_forward_length(cfg.ffn)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    w.add_array(f"{ARCH}.target_layers", list(cfg.target_layers))
    for key, val in target_metadata.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
            if isinstance(val, list):
                w.add_array(key, val)
            elif isinstance(val, str):
                w.add_string(key, val)
            elif isinstance(val, bool):
                w.add_bool(key, val)
            else:
                w.add_key_value(key, val, GGUFValueType.UINT32)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token)

    def put(n, x):
        x = np.asarray(x, np.float32)
        w.add_tensor(n, np.ascontiguousarray(x.T).astype(np.float16) if x.ndim == 2 else x)

    put("fc.weight", params["fc"])
    put("enc.output_norm.weight", params["enc_norm"])
    put("output_norm.weight", params["final_norm"])
    for i, lp in enumerate(params["layers"]):
        for ours in LAYER:
            put(f"blk.{i}.{_FILE[ours]}.weight", lp[ours])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
