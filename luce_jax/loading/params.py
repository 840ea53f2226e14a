"""The params pytree of a GGUF model: which file tensors make each weight, on the device,
fused the way the models and kernels take them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from types import SimpleNamespace

from gguf import GGMLQuantizationType
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..models import fused_layout
from ..models.family import family_of
from .gguf import GGUFFile

log = logging.getLogger(__name__)


def abstract_params(
    f: GGUFFile, cfg: ModelConfig, dtype: str = "bfloat16", quantized: bool = False
) -> tuple[ModelConfig, dict]:
    """load_params' (cfg, params) with jax.ShapeDtypeStruct leaves, from the header alone (no
    tensor byte is read or copied): enough to size the KV pool and compile every step while
    the weights load. A tensor load_params would refuse is refused here the same way."""
    import jax

    out = {}

    def shapes():
        out["cfg"], params = load_params(f, cfg, dtype, quantized, abstract=True)
        return params

    params = jax.eval_shape(shapes)
    return out["cfg"], params


def load_params(
    f: GGUFFile,
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    quantized: bool = False,
    abstract: bool = False,
    placement=None,
    expert_order=None,
) -> tuple[ModelConfig, dict]:
    """Copy the model's tensors to the device, dequantized to `dtype` or kept in their blocks.

    Args:
      dtype: the float dtype of dequantized weights, and the dtype every projection runs in.
      quantized: keep quantized tensors (ggml_blocks.FORMATS types) in their GGUF blocks, as
        QuantWeight [out, in]; float tensors are cast to dtype.
      abstract: zeros stand for the file's bytes (traced under abstract_params' eval_shape:
        nothing is read, and nothing runs on worker threads, whose traces would be their own).
      placement: several devices (device/mesh.py's Placement): tensors are unpacked and fused
        on its `loading_device` (the host's, not an accelerator of the mesh) and each layer's
        params go to the mesh as soon as they are made, each device receiving only its shard
        (`load_onto`). No device of the mesh holds a split weight whole, and the host holds
        about one layer's tensors (plus the prefetch window) rather than the model.
      expert_order: [L_moe, E] (expert_stats.balanced_order): each MoE layer's experts stored
        in that order, the router's columns with them (`reorder_experts`); None: file order.
    Returns:
      (cfg with tied_embeddings set, params). Dense linear weights are stored [in, out] and the
      q/k/v and gate/up projections are fused: wqkv [d, (H+2K)*D], w_gu [d, 2F] (QuantWeights
      of one type fuse along their rows; of different types they stay a tuple, see
      models/linear.py); MoE layers hold router [d, E], w_gu_exps [E, d, 2F] and
      w_down_exps [E, F, d] instead (QuantWeight [E, 2F, d] and [E, d, F]). A hybrid model's
      (qwen35) Gated DeltaNet layers hold w_in [d, C + Hv*Dv + 2Hv] (q, k, v | z | beta |
      alpha), conv [C, Kc], dt_bias, ssm_a [Hv], ssm_norm [Dv] and w_out [Hv*Dv, d]; its full
      attention wqkv yields query|gate per head first, [d, 2H*D + 2K*D].
    """
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quant_weight import QuantWeight

    from .prefetch import Prefetch, load_order
    from .quants import DEQUANTIZERS, INTEGER_TYPES, QTYPES, dequantize, prepare

    dt = jnp.dtype(dtype)
    # never packed: read as they are
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
             *INTEGER_TYPES)  # fmt: skip
    unpacked: dict[GGMLQuantizationType, list[str]] = {}  # types that could not stay packed

    def raw(n):  # the tensor's bytes, or traced zeros standing for them
        return jnp.zeros((f.tensors[n].nbytes,), jnp.uint8) if abstract else f.raw(n)

    # unpacking runs where the loader's own arrays go: the default device, or the host's
    here = contextlib.nullcontext if placement is None else (
        lambda: jax.default_device(placement.loading_device))  # fmt: skip

    # every quantized tensor is prepared as kept when quantized (those that are not re-made)
    def made(n):
        t = f.tensors[n]
        with here():  # on a worker thread: jax.default_device is the thread's own
            return prepare(raw(n), t.qtype, t.shape, dt, quantized)

    shapes = expected_shapes(cfg)
    order = load_order([(n, t.nbytes) for n, t in f.tensors.items()])
    fetch = Prefetch(order, made, workers=0 if abstract else 4)
    with fetch, here():  # its threads end with the load, or its error
        bar = tqdm(
            total=sum(t.nbytes for t in f.tensors.values()),
            unit="B",
            unit_scale=True,
            desc=f"loading {Path(f.path).name}",
            leave=False,
            disable=abstract or None,
        )

        def tensor(name, transpose=False, optional=False, out_dtype=dt, keep=False):
            """A file tensor on the device: a QuantWeight if `keep` and quantized allow it, else
            dequantized (and transposed to [in, out] for a linear weight)."""
            if name not in f.tensors:
                if optional:
                    return None
                raise ValueError(f"{f.path}: missing tensor {name!r}")
            t = f.tensors[name]
            want = shapes.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
            squeeze = want is not None and check_shape(f.path, name, t.shape, want)
            if t.qtype not in plain and (
                (keep and quantized and t.qtype not in QTYPES) or t.qtype not in DEQUANTIZERS
            ):
                unpacked.setdefault(t.qtype, []).append(name)
            try:
                x = fetch.get(name)
                if isinstance(x, QuantWeight) and not keep:  # prepared for a kept call site
                    x = prepare(raw(name), t.qtype, t.shape, dt, False)
                if not isinstance(x, QuantWeight):
                    x = dequantize(None, t.qtype, t.shape, out_dtype, transpose, blocks=x)
            except ValueError as e:
                raise ValueError(f"{f.path}: tensor {name!r}: {e}") from e
            bar.update(t.nbytes)
            return x.reshape(want) if squeeze else x

        def linear(*names):
            """One projection from the named file tensors, outputs concatenated in order."""
            return fuse([tensor(n, True, keep=True) for n in names])

        f32 = jnp.float32

        def ffn(p: str) -> dict:
            """A layer's FFN: dense w_gu [d, 2F] (gate | up) and w_down [F, d], or a router [d, E]
            with experts [E, d, 2F] and [E, F, d], and a sigmoid-gated shared expert if any."""
            if not cfg.n_experts:
                return {
                    "w_gu": linear(p + "ffn_gate.weight", p + "ffn_up.weight"),
                    "w_down": linear(p + "ffn_down.weight"),
                }
            gate, up, down = (
                tensor(p + f"ffn_{x}_exps.weight", True, keep=True) for x in ("gate", "up", "down")
            )
            out = {
                "router": tensor(p + "ffn_gate_inp.weight", True, out_dtype=f32),
                # DeepSeek's selection bias (e_score_correction_bias), where the file has one
                "router_bias": tensor(p + "exp_probs_b.bias", optional=True, out_dtype=f32),
                "w_gu_exps": fuse([gate, up], experts=True),
                "w_down_exps": down,
            }
            if out["router_bias"] is None:
                del out["router_bias"]
            if cfg.shared_expert_ffn_dim:
                # [d]: llama.cpp's converter writes [1, d] (GGUF [d, 1]), check_shape squeezes
                # it; DeepSeek's shared expert has no gate
                gate = tensor(p + "ffn_gate_inp_shexp.weight", optional=True, out_dtype=f32)
                if gate is not None:
                    out["shexp_gate"] = gate
                out["w_gu_shexp"] = linear(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")
                out["w_down_shexp"] = linear(p + "ffn_down_shexp.weight")
            return out

        family = family_of(cfg)
        t = SimpleNamespace(tensor=tensor, linear=linear, ffn=ffn, f32=f32)
        onto = (lambda tree: tree) if placement is None else placement.load_onto
        layers, moe = [], 0
        for i in range(cfg.n_layers):
            lp = family.layer_params(cfg, i, t)
            if expert_order is not None and "router" in lp:
                lp, moe = reorder_experts(lp, expert_order[moe]), moe + 1
            if placement is not None:  # fused projections shard by shard (fused_layout.py)
                lp = fused_layout.store(lp, cfg, placement.n, placement.delta is not None)
            layers.append(onto(lp))
        params = {
            "embed": tensor("token_embd.weight", keep=True),
            "final_norm": tensor("output_norm.weight", out_dtype=f32),
            "layers": layers,
            **family.model_params(cfg, t),
        }
        lm_head = tensor("output.weight", True, optional=True, keep=True)
        if lm_head is not None:
            params["lm_head"] = lm_head
        freqs = tensor("rope_freqs.weight", optional=True, out_dtype=f32)
        if freqs is not None:
            params["rope_freqs"] = freqs
        bar.close()
        for qtype, tensors in () if abstract else unpacked.items():
            log.warning(
                "%d %s tensor(s) (%s%s) %s: dequantized to %s at load%s",
                len(tensors),
                qtype.name,
                ", ".join(tensors[:3]),
                ", ..." if len(tensors) > 3 else "",
                "cannot stay packed" if quantized else "have no device dequantizer",
                dt.name,
                "" if qtype in DEQUANTIZERS else " (unpacked on the host, slower)",
            )
        params = {**onto({k: v for k, v in params.items() if k != "layers"}), "layers": layers}
        vocab = params["embed"].shape[0]
        if vocab != cfg.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=vocab)
        return dataclasses.replace(cfg, tied_embeddings=lm_head is None), params


def reorder_experts(lp: dict, order) -> dict:
    """A MoE layer's params with its experts stored in `order` (file ids, [E]): the stacked
    experts and the router's columns (and selection bias) taken in that order, a hash-routed
    layer's token -> experts table pointing at the new places. Routing then picks the same
    experts, at their new indices: the layer's output does not change."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    idx = jnp.asarray(order)
    out = dict(lp)
    for k in ("w_gu_exps", "w_down_exps"):
        out[k] = jax.tree.map(lambda a: jnp.take(a, idx, axis=0), lp[k])
    out["router"] = jnp.take(lp["router"], idx, axis=1)
    if "router_bias" in lp:
        out["router_bias"] = jnp.take(lp["router_bias"], idx)
    if "tid2eid" in lp:
        place = jnp.asarray(np.argsort(order), lp["tid2eid"].dtype)  # file id -> stored index
        out["tid2eid"] = place[lp["tid2eid"]]
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The numpy-order shape (GGUF's reversed) `cfg` expects of each file tensor, by its name
    without the blk.N. prefix; None for a dimension it does not fix (the vocabulary). The
    family's own tensors come from its tensor_shapes."""
    d, H, K, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    E, Fe, Fs = cfg.n_experts, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim
    q = H * D * (2 if cfg.attn_gate else 1)  # a gated query also yields its gate
    return {
        "token_embd.weight": (None, d),
        "output.weight": (None, d),
        "output_norm.weight": (d,),
        "rope_freqs.weight": ((cfg.rope_dim or D) // 2,),
        "attn_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "post_attention_norm.weight": (d,),
        "attn_q.weight": (q, d),
        "attn_k.weight": (K * D, d),
        "attn_v.weight": (K * D, d),
        "attn_output.weight": (d, H * D),
        "attn_q.bias": (H * D,),
        "attn_k.bias": (K * D,),
        "attn_v.bias": (K * D,),
        "attn_q_norm.weight": (D,),
        "attn_k_norm.weight": (D,),
        "ffn_gate.weight": (cfg.ffn_dim, d),
        "ffn_up.weight": (cfg.ffn_dim, d),
        "ffn_down.weight": (d, cfg.ffn_dim),
        "ffn_gate_inp.weight": (E, d),
        "exp_probs_b.bias": (E,),
        "ffn_gate_exps.weight": (E, Fe, d),
        "ffn_up_exps.weight": (E, Fe, d),
        "ffn_down_exps.weight": (E, d, Fe),
        "ffn_gate_inp_shexp.weight": (d,),
        "ffn_gate_shexp.weight": (Fs, d),
        "ffn_up_shexp.weight": (Fs, d),
        "ffn_down_shexp.weight": (d, Fs),
        **family_of(cfg).tensor_shapes(cfg),
    }


def check_shape(path, name: str, shape: tuple, want: tuple) -> bool:
    """Whether a file tensor of `shape` must be reshaped to `want` (it differs only by unit
    dimensions, as a converter's [d, 1] vector); a tensor that does not fit raises one line
    that names it, in GGUF's order (ne0 first), as gguf-dump prints shapes."""

    def fits(s):
        return len(s) == len(want) and all(w in (None, x) for w, x in zip(want, s, strict=True))

    if fits(shape):
        return False
    if None not in want and fits(tuple(x for x in shape if x != 1)):
        return True
    ggml = lambda s: "[" + ", ".join("n" if x is None else str(x) for x in reversed(s)) + "]"
    raise ValueError(
        f"{path}: tensor {name!r} has shape {ggml(shape)}; the file's metadata makes it "
        f"{ggml(want)} (n: any)"
    )


def fuse(parts: list, experts: bool = False):
    """Projections that share an input as one weight: dense [in, out] parts concatenated along
    their outputs, QuantWeights of one type along their rows; otherwise a tuple (models/linear.py
    concatenates the outputs) in which neighbours of one type are still one weight (a Q4_K_M
    layer's q and k, beside its Q6_K v: one matmul call fewer). Stacked experts must fuse: a
    tuple of QuantWeights of different types is dequantized, with a warning."""
    import jax.numpy as jnp

    from pallas_kernels.quant_weight import QuantWeight, concat_rows, dequantize_weight

    if len(parts) == 1:
        return parts[0]
    quant = [p for p in parts if isinstance(p, QuantWeight)]
    if not quant:
        return jnp.concatenate(parts, axis=-1)
    runs = []  # neighbours of one quantized type, in order
    for p in parts:
        same = runs and isinstance(p, QuantWeight) and isinstance(runs[-1][-1], QuantWeight)
        if same and runs[-1][-1].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) == 1:  # every part quantized, of one type
        return concat_rows(runs[0])
    if not experts:
        return tuple(concat_rows(r) if len(r) > 1 else r[0] for r in runs)
    log.warning(
        "expert tensors of types %s cannot share one grouped matmul; dequantized",
        [p.qtype if isinstance(p, QuantWeight) else str(p.dtype) for p in parts],
    )
    dt = quant[0].dtype
    dense = [
        jnp.swapaxes(dequantize_weight(p, dt), -1, -2) if isinstance(p, QuantWeight) else p
        for p in parts
    ]
    return jnp.concatenate(dense, axis=-1)


def weight_bytes(params) -> int:
    """Device bytes of a params pytree (quantized blocks counted as stored)."""
    import jax
    import jax.numpy as jnp

    return sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params)
    )  # from shapes: abstract_params' leaves count too
