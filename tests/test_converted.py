"""GGUF files made by llama.cpp's own converter and quantizer (tests/converted.py), not by our
writer: every layout the converter writes for the architectures we serve loads, computes what
transformers computes on the same weights, and is served end to end."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.loading.gguf import GGUFFile, model_config, open_gguf
from luce_jax.loading.params import load_params
from luce_jax.models import dense, hybrid
from luce_jax.step_format import Row, lower

import converted

P = 16


def greedy_logits(cfg, params, prompt, n=converted.GREEDY) -> np.ndarray:
    """Our float32 logits at the prompt's last position and after each of `n` greedy tokens
    ([n + 1, V]): the prompt in one step, then a decode step a token, every step in one
    64-token bucket (one compile)."""
    blocks = -(-(len(prompt) + n) // P)
    tables = np.arange(1, blocks + 1, dtype=np.int32)[None]
    if cfg.own is not None:
        kv, state = hybrid.init_kv(cfg, blocks + 1, P, jnp.float32), hybrid.init_state(cfg, 1)
        step = jax.jit(hybrid.forward, static_argnums=(4,))
    else:
        kv, state = dense.init_kv(cfg, blocks + 1, P, jnp.float32), None
        step = jax.jit(dense.forward, static_argnums=(3,))
    out, row = [], Row(0, tuple(prompt), 0, True)
    for i in range(n + 1):
        batch = lower([row], tables, P, 64, 1)
        if cfg.own is not None:
            batch["fresh"] = np.array([i == 0], np.int32)
            batch = {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in batch.items()}
            logits, kv, state, _ = step(params, kv, state, batch, cfg)
        else:
            logits, kv, _ = step(params, kv, {k: jnp.asarray(v) for k, v in batch.items()}, cfg)
        out.append(np.asarray(logits)[0])
        row = Row(0, (int(out[-1].argmax()),), row.start + len(row.tokens), True)
    return np.stack(out)


def load(path, dtype="float32", quantized=False):
    f = open_gguf(path)  # parsed once a file: the 151k-token vocabulary takes a second
    return f, *load_params(f, model_config(f.metadata), dtype, quantized)


@pytest.mark.parametrize("name", list(converted.VARIANTS))
def test_a_converter_made_file_computes_what_transformers_does(name):
    """float32 logits of a 40-token prompt and of 16 greedy steps after it within 1e-3 of
    transformers on the same weights, and the same greedy tokens (the engine's are checked
    against them where the file is served, below)."""
    ref, v = converted.reference(name), converted.VARIANTS[name]
    f, cfg, params = load(converted.gguf(name))
    assert cfg.arch == v.arch and cfg.tied_embeddings == v.tie
    assert ("rope_freqs" in params) == (v.rope_scaling is not None)
    if v.arch == "qwen3moe":  # no expert_weights_norm in the file: renormalized, as llama.cpp
        assert f"{v.arch}.expert_weights_norm" not in f.metadata and cfg.expert_weights_norm
    got = greedy_logits(cfg, params, ref["prompt"].tolist())
    assert got[:-1].argmax(-1).tolist() == ref["greedy"].tolist()
    np.testing.assert_allclose(got, ref["logits"], atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_mtp_layers_the_converter_exports_are_skipped(name):
    """The converter exports Qwen3.5's MTP block as one more block (nextn_predict_layers): the
    model is the blocks before it, and the block is counted apart (its tensors are read only
    for --spec-mode mtp: the next test)."""
    f = GGUFFile(converted.gguf(name))
    arch = f.metadata["general.architecture"]
    assert f.metadata[f"{arch}.nextn_predict_layers"] == 1
    n = f.metadata[f"{arch}.block_count"]
    assert any(t.startswith(f"blk.{n - 1}.nextn.") for t in f.tensors)
    cfg = model_config(f.metadata)
    assert cfg.n_layers == n - 1 and len(cfg.own.recurrent) == n - 1 and cfg.mtp_layers == 1


def test_a_tensor_of_the_wrong_shape_is_refused_in_one_line_naming_it(tmp_path):
    """A file whose tensor does not match its metadata fails at load, naming the tensor, its
    shape and the one expected: never an XLA shape error when the step compiles. (The
    converter's file, its model keys and tensors: the 151k-token vocabulary is not needed.)"""
    from gguf import GGUFValueType, GGUFWriter

    src = GGUFFile(converted.gguf("qwen3"))
    out = tmp_path / "bad.gguf"
    w = GGUFWriter(str(out), "qwen3")
    types = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
             str: GGUFValueType.STRING}  # fmt: skip
    for key, val in src.metadata.items():
        if key.startswith("qwen3."):
            w.add_key_value(key, val, types[type(val)])
    floats = {"F32": np.float32, "F16": np.float16}
    for t in src.tensors.values():
        x = np.asarray(src.raw(t.name)).view(floats[t.qtype.name]).reshape(t.shape)
        if t.name == "blk.1.attn_k.weight":
            x = x[:-1]  # one output row short
        w.add_tensor(t.name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(out)
    with pytest.raises(ValueError) as e:
        load_params(f, model_config(f.metadata), "float32")
    msg = str(e.value)
    assert "\n" not in msg and "'blk.1.attn_k.weight'" in msg
    assert "[64, 63]" in msg and "[64, 64]" in msg


@pytest.mark.parametrize("arch", list(converted.QUANTIZED))
def test_a_quantizer_made_file_dequantizes_as_gguf_py_and_keeps_its_tokens(arch):
    """llama-quantize's output: every tensor dequantizes to what gguf-py makes of it, and the
    model's logits and greedy tokens with the weights kept quantized equal those of the file
    dequantized at load. The tensors' bytes come from our reader (test_gguf.py checks it
    against gguf-py's): gguf-py's reader spends 10 s on the 151k-token vocabulary of each file."""
    from gguf.quants import dequantize as gguf_dequantize

    from luce_jax.loading.quants import dequantize

    path, qtype = converted.quantized(arch)
    f, cfg, kept = load(path, quantized=True)
    types = {t.qtype.name for t in f.tensors.values()}
    assert qtype.split("_K")[0].split("_M")[0] in " ".join(types), types
    for t in f.tensors.values():
        raw = np.asarray(f.raw(t.name))
        want = gguf_dequantize(raw, t.qtype).reshape(t.shape)
        got = np.asarray(dequantize(raw, t.qtype, t.shape, jnp.float32))
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=t.name)
    prompt = np.random.default_rng(1).integers(0, 100000, 24).tolist()
    _, _, dense_params = load(path)
    # the kept blocks' logits equal the dequantized ones' to float32 rounding (1.6e-5 at most
    # here), over the prompt and 4 greedy steps (each step decodes the 150k-row tied table)
    kept_logits = greedy_logits(cfg, kept, prompt, n=4)
    dense_logits = greedy_logits(cfg, dense_params, prompt, n=4)
    assert kept_logits.argmax(-1).tolist() == dense_logits.argmax(-1).tolist()
    np.testing.assert_allclose(kept_logits, dense_logits, atol=1e-4, rtol=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe"])
def test_a_converter_made_file_is_served_end_to_end(arch):
    """`python -m luce_jax.serve` on the file answers one chat completion through the
    official client, with the chat template the converter copied from the tokenizer."""
    ref = converted.reference(arch)
    check_served(converted.gguf(arch), ref["prompt"].tolist(), ref["greedy"].tolist())


def check_served(path, prompt: list[int], greedy: list[int], max_ctx: int = 256, chunk: int = 16,
                 slots: int = 1, pool: int = 0):  # fmt: skip
    """Serve `path` with `python -m luce_jax.serve`: a chat completion of a few tokens through
    the official client, then `greedy` (transformers' tokens) for `prompt`. (A test's engine
    of the same shapes has left the programs in the run's compile cache.)"""
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "luce_jax.serve", "--model", str(path),
           "--port", str(port), "--max-ctx", str(max_ctx), "--max-concurrency", str(slots),
           "--kv-pool-tokens", str(pool or 2 * max_ctx), "--prefill-chunk", str(chunk),
           "--prefill-token-budget", str(chunk)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                r = client.chat.completions.create(
                    model=client.models.list().data[0].id,
                    messages=[{"role": "user", "content": "Hello"}],
                    max_tokens=4,
                    temperature=0,
                )
                break
            except (openai.APIConnectionError, openai.InternalServerError):
                assert time.monotonic() < deadline, "the server did not come up in 300 s"
                time.sleep(0.5)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 4
        c = client.completions.create(model=r.model, prompt=prompt, max_tokens=len(greedy),
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        want = httpx.post(f"http://127.0.0.1:{port}/detokenize",
                          json={"tokens": greedy}).json()["prompt"]  # fmt: skip
        assert c.usage.completion_tokens == len(greedy) and c.choices[0].text == want
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_the_converters_mtp_block_computes_what_its_checkpoint_tensors_do(name):
    """The MTP block the converter wrote (nextn.* and the block's attention and FFN tensors),
    loaded as --spec-mode mtp loads it, gives the logits of the checkpoint's mtp.* tensors run
    by transformers' own Qwen3.5 decoder layer and norms: fc over [norm(embed(x)); norm(h)],
    the layer, the final norm, the lm_head (within 1e-4)."""
    import copy

    import torch

    from luce_jax.models import mtp
    from luce_jax.models.attention import paged_attention_xla
    from luce_jax.models.family import Kernels

    f, cfg, params = load(converted.gguf(name))
    assert cfg.mtp_layers == 1 and "mtp" in params
    model = converted.hf_model(name)
    tensors = converted._mtp_tensors(model, cfg.n_layers)
    full = model.config.layer_types.index("full_attention")
    layer = copy.deepcopy(model.model.layers[full])
    pre = "mtp.layers.0."
    layer.load_state_dict({k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)})
    norms = {}
    for k in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[k] = copy.deepcopy(model.model.norm)
        norms[k].weight.data = tensors[f"mtp.{k}.weight"].clone()
    T, rng = 12, np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, T)
    hidden = rng.normal(0, 1, (T, cfg.d_model)).astype(np.float32)
    with torch.no_grad():
        e = model.model.embed_tokens(torch.tensor(tokens)[None])
        u = torch.cat([norms["pre_fc_norm_embedding"](e),
                       norms["pre_fc_norm_hidden"](torch.tensor(hidden)[None])], -1)  # fmt: skip
        u = u @ tensors["mtp.fc.weight"].T
        pos = torch.arange(T)[None]
        x = layer(u, position_embeddings=model.model.rotary_emb(u, pos), position_ids=pos)
        want = model.lm_head(norms["norm"](x))[0].numpy()
    P = 16
    b = lower([Row(0, tuple(int(t) for t in tokens), 0, True)], np.array([[1]]), P, 16, 1)
    b = {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in b.items()}
    kv = hybrid.init_kv(cfg, 2, P, jnp.float32)[0]
    y, _ = mtp.block(params["mtp"], params["embed"], jnp.pad(jnp.asarray(hidden), ((0, 4), (0, 0))),
                     b["tokens"], kv, b, cfg, Kernels(attention=paged_attention_xla))  # fmt: skip
    got = np.asarray(mtp.logits(params["mtp"], params, y[:T], cfg, None))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
