"""Read GGUF files: metadata -> ModelConfig, tensors -> a params pytree on device.

The header is parsed here rather than with gguf.GGUFReader: the reader builds one numpy
array per string, which took 16 s for the 151936-token qwen2 vocabulary; this parser takes
well under a second. Tensor data stays memory-mapped until it is copied to the device.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..config import ModelConfig

log = logging.getLogger(__name__)

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
        # each key's GGUF value type (an array's: (ARRAY, its element type)): what a reader
        # that checks types (llama.cpp's) sees beside the value
        self.value_types: dict = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._unpack("<I")
            if vtype == _ARRAY:
                etype = struct.unpack_from("<I", self._mm, self._pos)[0]
                self.value_types[key] = (GGUFValueType(vtype), GGUFValueType(etype))
            else:
                self.value_types[key] = GGUFValueType(vtype)
            self.metadata[key] = self._value(vtype)
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


@functools.lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """GGUFFile(path), parsed once while the file is unchanged: serve checks the file before
    it binds the port and then loads it, and the Qwen2 vocabulary's header took 0.65 s to
    parse on a 2-core CPU."""
    st = os.stat(path)
    return _parsed(os.path.realpath(path), st.st_size, st.st_mtime_ns)


def model_config(md: dict) -> ModelConfig:
    """ModelConfig from GGUF metadata: the fields every family shares, then its family's
    (models/family.py read_config); unknown architectures are an error that names them."""
    from ..models.family import family_for

    arch = md.get("general.architecture")
    family = family_for(arch)

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
    if scaling not in family.rope_scalings:
        raise ValueError(
            f"unsupported rope scaling {scaling!r}; supported: {', '.join(family.rope_scalings)}"
        )
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    # llama.cpp's converter exports MTP (next-token prediction) blocks after the model's own,
    # counted in block_count: the model is the blocks before them (theirs are read only to
    # propose: models/mtp.py).
    mtp_layers = int(get("nextn_predict_layers", 0))
    n_layers = int(get("block_count")) - mtp_layers
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(n_kv[0] if isinstance(n_kv, list) else n_kv),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length", 0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        rope_scaling=scaling,
        rope_scaling_factor=float(get("rope.scaling.factor", 1.0)),
        context_length=int(get("context_length", 4096)),
        mtp_layers=mtp_layers,
        **family.read_config(arch, get, md, n_layers),
    )
