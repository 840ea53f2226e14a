"""Tiny random transformers models made into GGUF files by llama.cpp's own converter and
quantizer (tests/llama_cpp.py), with the transformers reference the tests hold them to.

Each variant is one way the converter's output differs: tied or untied embeddings, Llama 3's
rope_freqs, qwen2's biases, qwen3moe with or without normalized top-k, and qwen35 and qwen35moe
with their MTP layers exported. Its tokenizer is a real one (the converter recognizes a BPE
tokenizer by hashing what it makes of a test text): tokenizer.json rebuilt from the sdist's
ggml-vocab-NAME.gguf, so a vocabulary of 128k to 152k tokens, at width 64.

Files are made once per cache (tests/llama_cpp.py), in a folder named by a hash of what
makes them (hf_gguf.py, the variants, REVISION): a change to any makes them anew.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import llama_cpp

HERE = Path(__file__).resolve().parent
PROMPT_LEN, GREEDY = 40, 16
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@dataclass(frozen=True)
class Variant:
    arch: str
    vocab: str  # the sdist's ggml-vocab-NAME.gguf the tokenizer comes from
    tie: bool = False
    rope_scaling: dict | None = None
    norm_topk: bool = True
    seed: int = 0
    hf: dict = field(default_factory=dict)  # more config.json fields (mtp_num_hidden_layers)


VARIANTS = {
    "llama": Variant("llama", "llama-bpe"),
    "llama-tied": Variant("llama", "llama-bpe", tie=True, seed=1),
    "llama3-rope": Variant("llama", "llama-bpe", rope_scaling=LLAMA3_ROPE, seed=2),
    "qwen2": Variant("qwen2", "qwen2", tie=True, seed=3),
    "qwen2-untied": Variant("qwen2", "qwen2", tie=False, seed=4),
    "qwen3": Variant("qwen3", "qwen2", tie=True, seed=5),
    "qwen3-untied": Variant("qwen3", "qwen2", seed=6),
    "qwen3moe": Variant("qwen3moe", "qwen2", seed=7),
    "qwen3moe-unnormed": Variant("qwen3moe", "qwen2", norm_topk=False, seed=8),
    "qwen35": Variant("qwen35", "qwen35", seed=9, hf={"mtp_num_hidden_layers": 1}),
    "qwen35moe": Variant("qwen35moe", "qwen35", seed=10, hf={"mtp_num_hidden_layers": 1}),
}
# Quantizer-made files: each architecture in one type, and every type at least once; K-quants
# need rows of 256 values, so these models are 256 wide.
QUANTIZED = {
    "llama": "Q4_K_M",
    "qwen2": "Q5_K_M",
    "qwen3": "Q6_K",
    "qwen3moe": "Q4_0",
    "qwen35": "IQ4_XS",
    "qwen35moe": "Q8_0",
}
TEMPLATE = {"llama-bpe": "meta-llama-Llama-3.1-8B-Instruct.jinja"}  # else Qwen3's
SPECIALS = {  # (bos, eos) tokens, add_bos: as the real models' tokenizer_config.json
    "llama-bpe": ("<|begin_of_text|>", "<|eot_id|>", True),
    "qwen2": (None, "<|im_end|>", False),
    "qwen35": (None, "<|im_end|>", False),
}


REVISION = 1  # raise when a change here changes the files or references


def _key() -> str:
    h = hashlib.sha256((HERE / "hf_gguf.py").read_bytes())
    h.update(repr((VARIANTS, QUANTIZED, REVISION, PROMPT_LEN, GREEDY)).encode())
    return h.hexdigest()[:12]


def folder() -> Path:
    d = llama_cpp.cache() / f"converted-{_key()}"
    d.mkdir(exist_ok=True)
    return d


def tokenizer_dir(vocab: str) -> Path:
    """tokenizer.json and tokenizer_config.json of `vocab`, as a checkpoint folder holds them."""
    d = folder() / f"tokenizer-{vocab}"
    with llama_cpp.locked(d.name):
        if (d / "tokenizer_config.json").is_file():
            return d
        from luce_jax.loading.gguf import GGUFFile
        from luce_jax.loading.tokenizer import GGUFVocab, build_hf_tokenizer

        src = llama_cpp.source() / "models" / f"ggml-vocab-{vocab}.gguf"
        tok = build_hf_tokenizer(GGUFVocab.from_metadata(GGUFFile(src).metadata))
        d.mkdir(exist_ok=True)
        tok.save(str(d / "tokenizer.json"))
        bos, eos, add_bos = SPECIALS[vocab]
        template = llama_cpp.source() / "models" / "templates"
        template = (template / TEMPLATE.get(vocab, "Qwen-Qwen3-0.6B.jinja")).read_text()
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "add_bos_token": add_bos,
            "chat_template": template,
            "model_max_length": 4096,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def hf_model(name: str, width: int = 64):
    """The variant's transformers model (float32, eval), made the same way every time."""
    from tokenizers import Tokenizer

    from hf_gguf import make_hf_model

    v = VARIANTS[name]
    tok = Tokenizer.from_file(str(tokenizer_dir(v.vocab) / "tokenizer.json"))
    bos, eos, _ = SPECIALS[v.vocab]
    ids = (None if bos is None else tok.token_to_id(bos), tok.token_to_id(eos))
    return make_hf_model(
        v.arch,
        seed=v.seed,
        vocab=tok.get_vocab_size(),
        tie=v.tie,
        rope_scaling=v.rope_scaling,
        width=width,
        ffn=width * 3 // 2 if width == 64 else width,
        special=ids,
        norm_topk=v.norm_topk,
    )


def _mtp_tensors(model, n_layers: int) -> dict:
    """Random tensors of one MTP block (Qwen3.5's mtp.* names: the converter maps them to the
    block after the last, as nextn.*): a full-attention layer and its input projection."""
    import torch

    g = torch.Generator().manual_seed(0)
    sd, d = model.state_dict(), model.config.hidden_size
    full = next(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    out = {
        "mtp.fc.weight": torch.randn(d, 2 * d, generator=g) * 0.05,
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(d),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(d),
        "mtp.norm.weight": torch.zeros(d),
    }
    prefix = f"model.layers.{full}."
    for k, t in sd.items():
        if k.startswith(prefix):
            out["mtp.layers.0." + k[len(prefix) :]] = torch.randn(t.shape, generator=g) * 0.05
    return out


def checkpoint(name: str, width: int = 64) -> Path:
    """The variant as a transformers checkpoint folder (safetensors, config, tokenizer)."""
    d = folder() / f"hf-{name}-{width}"
    with llama_cpp.locked(d.name):
        if (d / "done").is_file():
            return d
        from safetensors.torch import save_file

        v = VARIANTS[name]
        model = hf_model(name, width)
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        if v.hf:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **v.hf}))
        if v.hf.get("mtp_num_hidden_layers"):
            save_file(_mtp_tensors(model, model.config.num_hidden_layers),
                      str(d / "mtp.safetensors"))  # fmt: skip
            index = {"metadata": {}, "weight_map": {}}
            from safetensors import safe_open

            for f in ("model.safetensors", "mtp.safetensors"):
                with safe_open(str(d / f), "pt") as st:
                    index["weight_map"].update(dict.fromkeys(st.keys(), f))
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_dir(v.vocab) / f, d / f)
        (d / "done").write_text("")
    return d


def gguf(name: str) -> Path:
    """The variant converted by convert_hf_to_gguf.py to float32 GGUF."""
    out = folder() / f"{name}-f32.gguf"
    if not out.is_file():
        llama_cpp.convert(checkpoint(name), out)
        shutil.rmtree(checkpoint(name))  # 40 to 80 MB a variant, read only by the converter
    return out


def quantized(arch: str) -> tuple[Path, str]:
    """(arch's 256-wide model quantized by llama-quantize to QUANTIZED[arch], the type)."""
    qtype = QUANTIZED[arch]
    out = folder() / f"{arch}-256-{qtype}.gguf"
    if not out.is_file():  # the float32 file and checkpoint are 300 to 600 MB: not kept
        f32 = llama_cpp.convert(checkpoint(arch, 256), folder() / f"{arch}-256-f32.gguf")
        llama_cpp.quantize(f32, out, qtype)
        f32.unlink()
        shutil.rmtree(checkpoint(arch, 256))
    return out, qtype


def reference(name: str) -> dict:
    """transformers on the variant: a 40-token prompt, 16 greedy tokens after it, and the
    float32 logits of the prompt's last position and of each greedy step ([17, V])."""

    def model():
        m = hf_model(name)
        # llama.cpp's converter writes no expert_weights_norm for qwen3moe and llama.cpp
        # always renormalizes its top-k (src/models/qwen3moe.cpp): that is what the file means
        for module in m.modules():
            if hasattr(module, "norm_topk_prob"):
                module.norm_topk_prob = True
        return m

    out = folder() / f"{name}-reference.npz"
    return greedy_reference(out, model, VARIANTS[name].seed, PROMPT_LEN, GREEDY)


def greedy_reference(out: Path, model_fn, seed: int, prompt_len: int, greedy: int) -> dict:
    """transformers' model_fn() on a random prompt_len prompt (of the seed), `greedy` greedy
    tokens after it, and the float32 logits of the prompt's last position and of each greedy
    step ([greedy + 1, V]): made once into `out`, then read."""

    def make(partial):
        import torch

        model = model_fn()
        prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, prompt_len)
        seq = prompt.tolist()
        with torch.no_grad():
            for _ in range(greedy):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            logits = model(torch.tensor([seq])).logits[0, prompt_len - 1 :].numpy()
        with open(partial, "wb") as fh:
            np.savez(fh, prompt=prompt, greedy=np.array(seq[prompt_len:]), logits=logits)

    llama_cpp.made(out, make)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


if __name__ == "__main__":  # make every file ahead of the suite
    for n in VARIANTS:
        print(gguf(n), reference(n)["logits"].shape, flush=True)
    for a in QUANTIZED:
        print(*quantized(a), flush=True)
