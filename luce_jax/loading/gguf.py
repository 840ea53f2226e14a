"""Read GGUF files: metadata -> ModelConfig, tensors -> a params pytree on device.

The header is parsed here rather than with gguf.GGUFReader: the reader builds one numpy
array per string, which took 16 s for the 151936-token qwen2 vocabulary; this parser takes
well under a second. Tensor data stays memory-mapped until it is copied to the device.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm.auto import tqdm

from ..config import ModelConfig

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe")
HYBRID = ("qwen35", "qwen35moe")  # Gated DeltaNet + gated attention (models/hybrid.py)
# GGUF value types -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (ggml's ne reversed)
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF header plus a read-only memory map of the tensor data."""

    def __init__(self, path: str | Path):
        """Parse the header. A file that is not a complete GGUF (empty, cut short, random
        bytes) is a ValueError that says so, not a struct or mmap error."""
        self.path = str(path)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"{self.path}: not a GGUF file, or cut short ({e})") from None
        size = len(self._mm)
        for t in self.tensors.values():
            if t.offset + t.nbytes > size:
                raise ValueError(
                    f"{self.path}: cut short: tensor {t.name!r} ends at byte "
                    f"{t.offset + t.nbytes}, the file has {size}"
                )

    def _parse(self) -> None:
        if Path(self.path).stat().st_size == 0:
            raise ValueError(f"{self.path}: empty file")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._mm
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (bad magic)")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            raw_type, offset = self._unpack("<I"), self._unpack("<Q")
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown GGML type id {raw_type}") from None
            infos.append((name, qtype, tuple(reversed(dims)), offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, qtype, shape, offset in infos:
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * size
            self.tensors[name] = TensorInfo(name, qtype, shape, data_start + offset, nbytes)

    def _unpack(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self._mm[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, n = self._unpack("<I"), self._unpack("<Q")
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1])
                arr = np.frombuffer(self._mm, dt, n, self._pos).copy()
                self._pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        return self._unpack(_SCALARS[vtype][0])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a view into the memory map)."""
        t = self.tensors[name]
        return self._mm[t.offset : t.offset + t.nbytes]


def model_config(md: dict) -> ModelConfig:
    """ModelConfig from GGUF metadata; unknown architectures are an error that names them."""
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")

    def get(key, default=None):
        v = md.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return v

    n_heads = int(get("attention.head_count"))
    d_model = int(get("embedding_length"))
    n_kv = get("attention.head_count_kv", n_heads)
    head_dim = int(get("attention.key_length", d_model // n_heads))
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"unsupported rope scaling {scaling!r}; supported: none, linear")
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv[0] if isinstance(n_kv, list) else n_kv),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length", 0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        # llama.cpp runs llama with adjacent-pair RoPE (its converter permutes Q/K to match);
        # qwen2 and qwen3 rotate halves (NEOX).
        rope_neox=arch != "llama",
        rope_scaling=scaling,
        rope_scaling_factor=float(get("rope.scaling.factor", 1.0)),
        qk_norm=arch in ("qwen3", "qwen3moe", *HYBRID),
        attn_bias=arch == "qwen2",
        context_length=int(get("context_length", 4096)),
        **(_moe_config(get) if arch in ("qwen3moe", "qwen35moe") else {}),
        **(_hybrid_config(get, md, arch) if arch in HYBRID else {}),
    )


def _hybrid_config(get, md: dict, arch: str) -> dict:
    """Gated DeltaNet fields of ModelConfig, as llama.cpp's qwen35 loader reads them: which
    layers are recurrent (attention.recurrent_layers, else every layer but each
    full_attention_interval-th), and the ssm.* sizes."""
    n = int(get("block_count"))
    flags = md.get(f"{arch}.attention.recurrent_layers")
    if flags is None:
        every = int(get("full_attention_interval", 4))
        flags = [(i + 1) % every != 0 for i in range(n)]
    v_heads = int(get("ssm.time_step_rank"))
    return dict(
        recurrent=tuple(bool(f) for f in flags[:n]),
        attn_gate=True,
        ssm_conv=int(get("ssm.conv_kernel")),
        ssm_k_heads=int(get("ssm.group_count")),
        ssm_v_heads=v_heads,
        ssm_k_dim=int(get("ssm.state_size")),
        ssm_v_dim=int(get("ssm.inner_size")) // v_heads,
    )


def _moe_config(get) -> dict:
    """Expert fields of ModelConfig. llama.cpp renormalizes qwen3moe's top-k router weights
    unless the file says otherwise (expert_weights_norm), as Qwen3-MoE's norm_topk_prob does."""
    return dict(
        n_experts=int(get("expert_count")),
        n_experts_used=int(get("expert_used_count")),
        expert_ffn_dim=int(get("expert_feed_forward_length")),
        expert_weights_norm=bool(get("expert_weights_norm", True)),
        shared_expert_ffn_dim=int(get("expert_shared_feed_forward_length", 0)),
    )


def load_params(
    f: GGUFFile, cfg: ModelConfig, dtype: str = "bfloat16", quantized: bool = False
) -> tuple[ModelConfig, dict]:
    """Copy the model's tensors to the device, dequantized to `dtype` or kept in their blocks.

    Args:
      dtype: the float dtype of dequantized weights, and the dtype every projection runs in.
      quantized: keep quantized tensors (ggml_blocks.FORMATS types) in their GGUF blocks, as
        QuantWeight [out, in]; float tensors are cast to dtype.
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
    import jax.numpy as jnp

    from .quants import DEQUANTIZERS, QTYPES, dequantize, keep_quantized

    dt = jnp.dtype(dtype)
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    unpacked: dict[GGMLQuantizationType, list[str]] = {}  # types that could not stay packed
    names = [n for n in f.tensors]
    bar = tqdm(
        total=sum(f.tensors[n].nbytes for n in names),
        unit="B",
        unit_scale=True,
        desc=f"loading {Path(f.path).name}",
        leave=False,
    )

    def tensor(name, transpose=False, optional=False, out_dtype=dt, keep=False):
        """A file tensor on the device: a QuantWeight if `keep` and quantized allow it, else
        dequantized (and transposed to [in, out] for a linear weight)."""
        if name not in f.tensors:
            if optional:
                return None
            raise ValueError(f"{f.path}: missing tensor {name!r}")
        t = f.tensors[name]
        x = keep_quantized(f.raw(name), t.qtype, t.shape, dt) if keep and quantized else None
        if t.qtype not in floats and (
            (keep and quantized and t.qtype not in QTYPES) or t.qtype not in DEQUANTIZERS
        ):
            unpacked.setdefault(t.qtype, []).append(name)
        if x is None:
            try:
                x = dequantize(f.raw(name), t.qtype, t.shape, out_dtype, transpose)
            except ValueError as e:
                raise ValueError(f"{f.path}: tensor {name!r}: {e}") from e
        bar.update(t.nbytes)
        return x

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
            "w_gu_exps": fuse([gate, up], experts=True),
            "w_down_exps": down,
        }
        if cfg.shared_expert_ffn_dim:
            out["shexp_gate"] = tensor(p + "ffn_gate_inp_shexp.weight", out_dtype=f32)  # [d]
            out["w_gu_shexp"] = linear(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")
            out["w_down_shexp"] = linear(p + "ffn_down_shexp.weight")
        return out

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        if cfg.recurrent and cfg.recurrent[i]:  # Gated DeltaNet (qwen35)
            layers.append(
                {
                    "attn_norm": tensor(p + "attn_norm.weight", out_dtype=f32),
                    # q, k, v (the convolution's channels) | z gate | beta | alpha
                    "w_in": linear(*(p + x for x in _LINEAR_IN)),
                    "conv": tensor(p + "ssm_conv1d.weight", out_dtype=f32),  # [C, Kc]
                    "dt_bias": tensor(p + "ssm_dt.bias", out_dtype=f32),
                    "ssm_a": tensor(p + "ssm_a", out_dtype=f32),  # -exp(A_log)
                    "ssm_norm": tensor(p + "ssm_norm.weight", out_dtype=f32),
                    "w_out": linear(p + "ssm_out.weight"),
                    "ffn_norm": tensor(p + "post_attention_norm.weight", out_dtype=f32),
                    **ffn(p),
                }
            )
            continue
        ffn_norm = "post_attention_norm" if cfg.recurrent else "ffn_norm"
        layer = {
            "attn_norm": tensor(p + "attn_norm.weight", out_dtype=f32),
            "wqkv": linear(*(p + f"attn_{x}.weight" for x in "qkv")),
            "wo": linear(p + "attn_output.weight"),
            "ffn_norm": tensor(p + f"{ffn_norm}.weight", out_dtype=f32),
        }
        layer.update(ffn(p))
        if cfg.attn_bias:
            layer["bqkv"] = jnp.concatenate(
                [tensor(p + f"attn_{x}.bias", out_dtype=f32) for x in "qkv"]
            )
        if cfg.qk_norm:
            layer["q_norm"] = tensor(p + "attn_q_norm.weight", out_dtype=f32)
            layer["k_norm"] = tensor(p + "attn_k_norm.weight", out_dtype=f32)
        layers.append(layer)
    params = {
        "embed": tensor("token_embd.weight", keep=True),
        "final_norm": tensor("output_norm.weight", out_dtype=f32),
        "layers": layers,
    }
    lm_head = tensor("output.weight", True, optional=True, keep=True)
    if lm_head is not None:
        params["lm_head"] = lm_head
    freqs = tensor("rope_freqs.weight", optional=True, out_dtype=f32)
    if freqs is not None:
        params["rope_freqs"] = freqs
    bar.close()
    for qtype, tensors in unpacked.items():
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
    vocab = params["embed"].shape[0]
    if vocab != cfg.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
    return dataclasses.replace(cfg, tied_embeddings=lm_head is None), params


_LINEAR_IN = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")


def fuse(parts: list, experts: bool = False):
    """Projections that share an input as one weight: dense [in, out] parts concatenated along
    their outputs, QuantWeights of one type along their rows; otherwise a tuple (models/linear.py
    concatenates the outputs). Stacked experts must fuse: a tuple of QuantWeights of different
    types is dequantized, with a warning."""
    import jax.numpy as jnp

    from pallas_kernels.ggml_blocks import QuantWeight, concat_rows, dequantize_weight

    if len(parts) == 1:
        return parts[0]
    quant = [p for p in parts if isinstance(p, QuantWeight)]
    if not quant:
        return jnp.concatenate(parts, axis=-1)
    if len(quant) == len(parts) and len({p.qtype for p in quant}) == 1:
        return concat_rows(quant)
    if not experts:
        return tuple(parts)
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

    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
