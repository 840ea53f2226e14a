"""What speculation reads at start-up beside the model: a draft model's, a draft head's or a
DFlash drafter's weights, or the model file's own MTP block (its params are the model's, asked
for through ModelConfig.mtp_layers), and the KV bytes per token their caches add to the
model's first cache group, whose block ids they share (device/proposals.py)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from .config import EngineConfig


class Proposers(NamedTuple):
    draft: tuple | None  # (ModelConfig, params) of a draft model
    head: tuple | None  # (draft_head.HeadConfig, params)
    dflash: tuple | None  # (dflash.DFlashConfig, params, (k, v) cache types)
    kv_bytes: float  # per token, what their caches add to the first cache group


def mtp_config(config: EngineConfig, mc):
    """The model's config with its MTP blocks' params loaded only for spec_mode=mtp, which
    needs a family that runs them and a file that has one (models/mtp.py)."""
    from .models.family import family_of

    if config.spec_mode != "mtp":
        return dataclasses.replace(mc, mtp_layers=0)
    family = family_of(mc)
    if "mtp" not in family.device_proposers:
        raise ValueError(f"spec_mode='mtp': the {family.name} family's models run no MTP block")
    if not mc.mtp_layers:
        raise ValueError(f"spec_mode='mtp': {config.model} has no MTP block "
                         f"({mc.arch}.nextn_predict_layers)")  # fmt: skip
    if config.tensor_parallel > 1:
        raise ValueError("spec_mode='mtp': its block runs on one device (tensor_parallel=1)")
    return mc


def load_proposers(config: EngineConfig, mc, vocab, quantized: bool, group, clock) -> Proposers:
    """The proposer spec_mode reads (the model `mc`, its vocabulary, its first cache group
    `group`); a draft model loads first: its weights and KV share the memory."""
    from pallas_kernels import kv_cache

    from .build import kv_cache_types

    draft = head = dflash = None
    kv_bytes = 0.0
    if config.spec_mode == "draft":
        with clock.phase("draft weights"):
            draft = _draft_model(config, vocab, quantized)
        kv_bytes = sum(g.bytes_per_token for g in kv_cache_types(config, draft[0])[1])
    elif config.spec_mode == "mtp":  # one more attention layer's caches
        kv_bytes = group.bytes_per_token / group.layers
    elif config.spec_mode == "dflash":  # each draft layer's context rows
        dflash = _dflash(config, mc, vocab)
        d = dflash[0]
        kv_bytes = d.layers * d.kv_heads * d.head_dim * sum(map(kv_cache.bytes_per_value,
                                                                dflash[2]))  # fmt: skip
    elif config.spec_mode == "head":
        from .models import draft_head

        head = draft_head.load(config.draft_model, mc.d_model, mc.vocab_size, config.dtype)
    return Proposers(draft, head, dflash, kv_bytes)


def _check_vocab(path: str, md: dict, vocab) -> None:
    from .loading.tokenizer import GGUFVocab

    if GGUFVocab.from_metadata(md).tokens != vocab.tokens:
        raise ValueError(f"draft={path!r}: its vocabulary differs from the model's")


def _draft_model(config: EngineConfig, vocab, quantized: bool):
    """The draft model's (ModelConfig, params); its vocabulary must be the target's."""
    from .loading.gguf import GGUFFile, model_config
    from .loading.params import load_params

    f = GGUFFile(config.draft_model)
    _check_vocab(config.draft_model, f.metadata, vocab)
    return load_params(f, model_config(f.metadata), config.dtype, quantized)


def _dflash(config: EngineConfig, mc, vocab):
    """A DFlash drafter's (DFlashConfig, params, kv types) for the model: its tokenizer (where
    it has one) must be the model's and its block must hold draft_tokens + 1 tokens."""
    from .build import kv_cache_types
    from .loading.gguf import GGUFFile
    from .models import dflash

    if config.tensor_parallel > 1:
        raise ValueError("spec_mode='dflash': the drafter runs on one device (tensor_parallel=1)")
    path = config.draft_model
    md = GGUFFile(path).metadata
    if "tokenizer.ggml.tokens" in md:
        _check_vocab(path, md, vocab)
    dcfg, params = dflash.load(path, mc.d_model, mc.n_layers, config.dtype)
    if config.draft_tokens >= dcfg.block_size:
        raise ValueError(f"draft_tokens={config.draft_tokens}: the drafter's blocks hold "
                         f"{dcfg.block_size} tokens, so at most {dcfg.block_size - 1}")  # fmt: skip
    return dcfg, params, kv_cache_types(config, mc)[0]
