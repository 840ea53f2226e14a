"""DeepSeek V4 (llama.cpp's deepseek4 architecture): hyper-connections around every block, one
shared K = V head with sinks over a raw window, compressed attention (CSA with its lightning
indexer, HCA), and MoE layers whose first ones are routed by token id; one pure function over
a packed step (../shared/reference/deepseek4.md is the brief, transformers 5.25's
DeepseekV4ForCausalLM and llama.cpp's src/models/deepseek4.cpp the references).

Caches, in cache-group order: the raw window of every layer (sliding, W tokens), then the
CSA layers' entries (one per 4 tokens) with their indexer keys beside them, then the HCA
layers' (one per 128 tokens); a group no layer uses is left out. The compressors' open blocks
are slot state (rings, compressor.py), advanced in token order within each row, so a prompt
split over steps at any point computes what one pass does. The rings cannot go back a token,
so a verify row's accepted proposals are fed again ("refeed"), as for hybrid models.

Shapes: T tokens, S segments, S_max slots, n streams, d model width, D head width, V vocabulary.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import rms_norm

from ..config import ModelConfig
from . import moe
from .compressed_attention import StepTokens, attend
from .compressor import ring_rows
from .family import XLA, CacheGroup, Kernels, register
from .hyper_connection import hc_head, hc_post, hc_pre
from .linear import embed, linear
from .logits import head
from .tail_rope import inv_freq, yarn_inv_freq

log = logging.getLogger(__name__)

CSA, HCA = 4, 128  # the compression ratios llama.cpp takes (DSV4_CSA_RATIO, DSV4_HCA_RATIO)


@dataclass(frozen=True)
class DeepSeek4Config:
    """The deepseek4 family's fields of a ModelConfig (its `own`)."""

    ratios: tuple[int, ...]  # per layer: 0 (window only), CSA or HCA
    window: int  # W: raw positions every layer attends to, the current one included
    streams: int  # n: hyper-connection streams
    sinkhorn_iters: int
    hc_eps: float
    output_groups: int  # g of the grouped output LoRA
    index_heads: int
    index_dim: int
    index_topk: int
    hash_layers: int  # the first layers, routed by token id
    compress_rope_base: float
    # YaRN of the compressed layers' rope (factor, original context, beta_fast, beta_slow), or
    # None
    yarn: tuple | None

    def layers(self, ratio: int) -> int:
        return sum(r == ratio for r in self.ratios)


def rope_freqs(cfg: ModelConfig, ratio: int):
    """[r / 2] inverse frequencies of a layer's rope: the main base on window-only layers, the
    compress base with YaRN (attention factor 1) on compressed ones."""
    own, r = cfg.own, cfg.rope_dim
    if not ratio:
        return inv_freq(r, cfg.rope_base)
    if own.yarn is None:
        return inv_freq(r, own.compress_rope_base)
    return yarn_inv_freq(r, own.compress_rope_base, *own.yarn)


# attend's names for a compressed layer's caches and rings -> init_caches' / init_state's keys
_CACHES = {CSA: {"entries": "csa", "index": "index"}, HCA: {"entries": "hca"}}
_RINGS = {
    CSA: {
        "kv": "csa_kv",
        "score": "csa_score",
        "index_kv": "index_kv",
        "index_score": "index_score",
    },
    HCA: {"kv": "hca_kv", "score": "hca_score"},
}


def _groups(cfg: ModelConfig) -> dict[int, int]:
    """ratio -> its cache group's index, for the ratios some layer has (the window is 0)."""
    out = {0: 0}
    for ratio in (CSA, HCA):
        if cfg.own.layers(ratio):
            out[ratio] = len(out)
    return out


def init_state(cfg: ModelConfig, max_slots: int) -> dict:
    """Zeroed compressor rings (float32): L_ratio arrays [S_max, R, w] (a layer's own, so
    its compressor's scatter updates it in place; slices of one [L_ratio, ...] array were
    copied out and back each step) of values ("*_kv") and gate scores with the position bias
    added ("*_score"), for CSA's main compressor (w = 2D) and its indexer's (w = 2 dI), and
    HCA's (w = D)."""
    own, D = cfg.own, cfg.head_dim
    shapes = {
        "csa": (own.layers(CSA), ring_rows(CSA, True), 2 * D),
        "index": (own.layers(CSA), ring_rows(CSA, True), 2 * own.index_dim),
        "hca": (own.layers(HCA), ring_rows(HCA, False), D),
    }
    return {
        f"{name}_{part}": tuple(jnp.zeros((max_slots, R, w), jnp.float32) for _ in range(n))
        for name, (n, R, w) in shapes.items()
        for part in ("kv", "score")
    }


def init_caches(cfg: ModelConfig, spaces, dtype) -> dict:
    """Zeroed caches: "window" [L] of [NB, P, D] (group 0), "csa" and "index" [L_CSA] of [NB,
    P, D] and [NB, P, dI], "hca" [L_HCA] of [NB, P, D] (their groups)."""
    own, D, g = cfg.own, cfg.head_dim, _groups(cfg)

    def zeros(group: int, width: int, n: int) -> list:
        s = spaces[group]
        return [jnp.zeros((s.num_blocks, s.block_size, width), dtype) for _ in range(n)]

    return {
        "window": zeros(0, D, cfg.n_layers),
        "csa": zeros(g.get(CSA, 0), D, own.layers(CSA)),
        "index": zeros(g.get(CSA, 0), own.index_dim, own.layers(CSA)),
        "hca": zeros(g.get(HCA, 0), D, own.layers(HCA)),
    }


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "ratio"))
def layer(lp: dict, X, caches: dict, rings: dict, tok: StepTokens, batch: dict, *,
          cfg: ModelConfig, kernels: Kernels, ratio: int):  # fmt: skip
    """One block: attention and the MoE FFN, each between its hyper-connection's pre and post.
    X [T, n, d] float32 streams; caches / rings: this layer's (compressed_attention.attend).
    Returns (X, caches, rings, the FFN's routing pairs)."""
    own, eps = cfg.own, cfg.rms_eps
    live = batch["cu_q_lens"][-1]
    qmm = kernels.quant_matmul

    def proj(x, w):
        return linear(x, w, qmm, live)

    hc = dict(eps=eps, hc_eps=own.hc_eps, iters=own.sinkhorn_iters, sinkhorn=kernels.sinkhorn)
    with jax.named_scope("hyper_connection"):
        y, post, comb = hc_pre(X, lp["hc_attn"], **hc)
        x = rms_norm(y, lp["attn_norm"], eps)
    a, caches, rings = attend(lp, x, caches, rings, tok, batch, ratio=ratio, window=own.window,
                              heads=cfg.n_heads, topk=own.index_topk,
                              freqs=rope_freqs(cfg, ratio), eps=eps,
                              groups=(0, _groups(cfg).get(ratio)), proj=proj,
                              attention=kernels.sink_attention)  # fmt: skip
    with jax.named_scope("hyper_connection"):
        X = hc_post(a, X, post, comb)
        y, post, comb = hc_pre(X, lp["hc_ffn"], **hc)
    with jax.named_scope("mlp"):
        f, pairs = moe.ffn(lp, rms_norm(y, lp["ffn_norm"], eps), cfg, kernels.grouped_matmul,
                           live, qmm, kernels.moe_router, tokens=batch["tokens"],
                           experts_on=kernels.experts, shards=kernels.shards)  # fmt: skip
    with jax.named_scope("hyper_connection"):
        return hc_post(f, X, post, comb), caches, rings, pairs


def forward(params: dict, caches: dict, state: dict, batch: dict, cfg: ModelConfig,
            kernels: Kernels = XLA):  # fmt: skip
    """One step over packed tokens: (logits [R, V] float32, caches, state, stats: expert_counts
    [L, E] int32, as dense.forward's).

    Args: params (load_params' pytree of a deepseek4 file); caches (init_caches'); state
      (init_state's); batch (step_format.lower's, with its groups' tables and write indices,
      slots, fresh and n_draft); kernels: the projections', MoE's and the sink attention's.
    """
    own = cfg.own
    tok = StepTokens.of(batch)
    # A reused slot's rings keep its last sequence's bytes: its new sequence reads none of
    # them. Its first row starts at position 0 (this family has no prefix cache), and a ring
    # is read only for positions before a row's run (compressor.py): HCA's sources are at or
    # past 0, CSA's before 0 count for nothing.
    with jax.named_scope("embed"):
        X = jnp.repeat(embed(params["embed"], batch["tokens"])[:, None, :], own.streams, axis=1)
    caches = {k: list(v) for k, v in caches.items()}
    state = {k: list(v) for k, v in state.items()}
    index = {CSA: 0, HCA: 0}  # a compressed layer's index among its ratio's
    routing = []
    for i, lp in enumerate(params["layers"]):
        ratio = own.ratios[i]
        j = index.get(ratio, 0)
        names, rings = _CACHES.get(ratio, {}), _RINGS.get(ratio, {})
        mine = {"window": caches["window"][i], **{k: caches[c][j] for k, c in names.items()}}
        ring = {k: state[r][j] for k, r in rings.items()}
        X, mine, ring, pairs = layer(lp, X, mine, ring, tok, batch, cfg=cfg, kernels=kernels,
                                     ratio=ratio)  # fmt: skip
        routing.append(pairs)
        caches["window"][i] = mine["window"]
        for k, c in names.items():
            caches[c][j] = mine[k]
        for k, r in rings.items():
            state[r][j] = ring[k]
        if ratio:
            index[ratio] += 1
    with jax.named_scope("hyper_connection"):
        h = hc_head(X, params["hc_head"], eps=cfg.rms_eps, hc_eps=own.hc_eps)
    logits = head(params, h, batch, cfg, kernels.quant_matmul)
    stats = {"expert_counts": moe.expert_counts(jnp.stack(routing), cfg.n_experts)}
    return logits, caches, {k: tuple(v) for k, v in state.items()}, stats


class DeepSeek4Family:
    """deepseek4 (models/family.py): the window, CSA and HCA cache groups, compressor rings in
    the slot. Rings hold no earlier position, so accepted proposals are fed again ("refeed")
    and the prefix cache is off; no proposer runs on the device."""

    name = "deepseek4"
    archs = ("deepseek4",)
    rollback = "refeed"
    prefix_cacheable = False
    device_proposers = frozenset()
    rope_scalings = ("none", "yarn")  # YaRN: the compressed layers' (rope_freqs)

    def read_config(self, arch: str, get, md: dict, n_layers: int) -> dict:
        """The GGUF keys llama.cpp 11434's converter writes (gguf-py constants.py :112-211;
        the brief's section 10): attention.compress_ratios, the indexer's, the
        hyper-connections', hash_layer_count, and the experts' (moe.read_config; the shared
        expert is expert_shared_count experts wide)."""
        ratios = tuple(int(r) for r in get("attention.compress_ratios"))[:n_layers]
        bad = sorted({r for r in ratios} - {0, CSA, HCA})
        if bad:
            raise ValueError(f"{arch}.attention.compress_ratios has {bad}: supported 0, 4, 128")
        if int(get("hyper_connection.count")) != 4:
            raise ValueError(f"{arch}.hyper_connection.count={get('hyper_connection.count')}: "
                             "4 streams (as llama.cpp)")  # fmt: skip
        yarn = None
        if md.get(f"{arch}.rope.scaling.type") == "yarn":
            yarn = (float(get("rope.scaling.factor")),
                    int(get("rope.scaling.original_context_length")),
                    float(get("rope.scaling.yarn_beta_fast", 32.0)),
                    float(get("rope.scaling.yarn_beta_slow", 1.0)))  # fmt: skip
        own = DeepSeek4Config(
            ratios=ratios,
            window=int(get("attention.sliding_window")),
            streams=int(get("hyper_connection.count")),
            sinkhorn_iters=int(get("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(get("hyper_connection.epsilon")),
            output_groups=int(get("attention.output_group_count")),
            index_heads=int(get("attention.indexer.head_count")),
            index_dim=int(get("attention.indexer.key_length")),
            index_topk=int(get("attention.indexer.top_k")),
            hash_layers=int(get("hash_layer_count", 0)),
            compress_rope_base=float(get("attention.compress_rope_freq_base")),
            yarn=yarn,
        )
        experts = moe.read_config(get)
        shared = int(get("expert_shared_count", 0)) * experts["expert_ffn_dim"]
        return dict(experts, shared_expert_ffn_dim=shared, rope_neox=False, own=own)

    def model_params(self, cfg: ModelConfig, t) -> dict:
        """The hyper-connections' head: hc_head {fn [n, n d], base [n], scale [1]}."""
        return {"hc_head": {k: t.tensor(f"output_hc_{k}.weight", out_dtype=t.f32)
                            for k in ("fn", "base", "scale")}}  # fmt: skip

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple]:
        own, d, D, H = cfg.own, cfg.d_model, cfg.head_dim, cfg.n_heads
        n, g = own.streams, own.output_groups
        Rq, Ro, HI, dI = None, None, own.index_heads, own.index_dim  # the LoRA ranks: any
        hc = {f"hc_{s}_{k}.weight": v for s in ("attn", "ffn")
              for k, v in (("fn", ((2 + n) * n, n * d)), ("base", ((2 + n) * n,)),
                           ("scale", (3,)))}  # fmt: skip
        return {
            **hc,
            "output_hc_fn.weight": (n, n * d),
            "output_hc_base.weight": (n,),
            "output_hc_scale.weight": (1,),
            "attn_sinks.weight": (H,),
            "attn_q_a.weight": (Rq, d),
            "attn_q_b.weight": (H * D, Rq),
            "attn_kv.weight": (D, d),
            "attn_kv_a_norm.weight": (D,),
            "attn_output_a.weight": (Ro, H * D // g),
            "attn_output_b.weight": (d, Ro),
            "attn_compressor_kv.weight": (None, d),  # 2D on CSA layers, D on HCA ones
            "attn_compressor_gate.weight": (None, d),
            "attn_compressor_norm.weight": (D,),
            "indexer.attn_q_b.weight": (HI * dI, Rq),
            "indexer.proj.weight": (HI, d),
            "indexer_compressor_kv.weight": (2 * dI, d),
            "indexer_compressor_gate.weight": (2 * dI, d),
            "indexer_compressor_ape.weight": (CSA, 2 * dI),
            "indexer_compressor_norm.weight": (dI,),
            "ffn_gate_tid2eid.weight": (None, cfg.n_experts_used),
        }

    def layer_params(self, cfg: ModelConfig, i: int, t) -> dict:
        """Block i: its hyper-connections (hc_attn, hc_ffn {fn, base, scale}), attention
        (shared_kv_attention's names, wo_a [g, H D / g, Ro]; a compressed layer's compressor,
        a CSA layer's indexer), norms and MoE FFN (tid2eid [V, k] on hash-routed layers)."""
        own, p, f32 = cfg.own, f"blk.{i}.", t.f32
        g = own.output_groups

        def site(name):
            return {k: t.tensor(f"{p}hc_{name}_{k}.weight", out_dtype=f32)
                    for k in ("fn", "base", "scale")}  # fmt: skip

        def compressor(prefix):
            return {"wkv": t.linear(prefix + "_kv.weight"),
                    "wgate": t.linear(prefix + "_gate.weight"),
                    "ape": t.tensor(prefix + "_ape.weight", out_dtype=f32),
                    "norm": t.tensor(prefix + "_norm.weight", out_dtype=f32)}  # fmt: skip

        wo_a = t.tensor(p + "attn_output_a.weight")  # [g Ro, H D / g]
        lp = {
            "hc_attn": site("attn"),
            "hc_ffn": site("ffn"),
            "attn_norm": t.tensor(p + "attn_norm.weight", out_dtype=f32),
            "ffn_norm": t.tensor(p + "ffn_norm.weight", out_dtype=f32),
            "sinks": t.tensor(p + "attn_sinks.weight", out_dtype=f32),
            "wq_a": t.linear(p + "attn_q_a.weight"),
            "q_norm": t.tensor(p + "attn_q_a_norm.weight", out_dtype=f32),
            "wq_b": t.linear(p + "attn_q_b.weight"),
            "wkv": t.linear(p + "attn_kv.weight"),
            "kv_norm": t.tensor(p + "attn_kv_a_norm.weight", out_dtype=f32),
            "wo_a": wo_a.reshape(g, wo_a.shape[0] // g, -1).transpose(0, 2, 1),
            "wo_b": t.linear(p + "attn_output_b.weight"),
            **t.ffn(p),
        }
        ratio = own.ratios[i]
        if ratio:
            lp["compressor"] = compressor(p + "attn_compressor")
        if ratio == CSA:
            lp["indexer"] = {"wq_b": t.linear(p + "indexer.attn_q_b.weight"),
                             "proj": t.linear(p + "indexer.proj.weight"),
                             "compressor": compressor(p + "indexer_compressor")}  # fmt: skip
        if i < own.hash_layers:
            lp["tid2eid"] = t.tensor(p + "ffn_gate_tid2eid.weight", out_dtype=jnp.int32)
            lp.pop("router_bias", None)  # hash layers select by the table alone
        if t.tensor(p + "exp_probs_b_vl.bias", optional=True, out_dtype=f32) is not None:
            log.info("blk.%d.exp_probs_b_vl.bias (image tokens' routing bias) ignored", i)
        return lp

    def cache_groups(self, cfg: ModelConfig, kv_bytes_per_entry: float) -> list[CacheGroup]:
        """The window (every layer's K = V row a token), then CSA's entries and indexer keys
        (a token's share of one entry in four) and HCA's (one in 128)."""
        own, D, L = cfg.own, cfg.head_dim, cfg.n_layers
        value = kv_bytes_per_entry / (2 * cfg.kv_size)  # one cached value's bytes (K = V)
        groups = [CacheGroup("sliding", L, L * D * value, window=own.window)]
        if own.layers(CSA):
            n = own.layers(CSA)
            groups.append(CacheGroup("compressed", n, n * (D + own.index_dim) * value / CSA,
                                     tokens_per_entry=CSA))  # fmt: skip
        if own.layers(HCA):
            n = own.layers(HCA)
            groups.append(CacheGroup("compressed", n, n * D * value / HCA, tokens_per_entry=HCA))
        return groups

    def init_caches(self, cfg: ModelConfig, spaces, k_type, v_type):
        if isinstance(k_type, str) or k_type != v_type:
            raise ValueError(f"cache_type_k={k_type!r}, cache_type_v={v_type!r}: DeepSeek V4's "
                             "caches hold one float type (K = V)")  # fmt: skip
        return init_caches(cfg, spaces, k_type)

    def init_slot_state(self, cfg: ModelConfig, max_slots: int, proposals: int = 0) -> dict:
        return init_state(cfg, max_slots)

    def forward(self, params, caches, slot_state, batch, cfg, kernels: Kernels, hidden=()):
        assert not hidden, "no device proposer reads a DeepSeek V4 model's hidden states"
        return forward(params, caches, slot_state, batch, cfg, kernels)


FAMILY = register(DeepSeek4Family())
