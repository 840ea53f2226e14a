"""A model split over several devices (device/mesh.py) serves what one device serves: greedy
tokens of batched, chunked requests equal one device's for dense, MoE, hybrid and DeepSeek V4
models, with experts split by expert or by FFN width, speculation on; each device holds only
its share of a split weight and of the KV heads; nothing compiles after warmup. The suite's
processes have four CPU devices (conftest.py)."""

import gc
import math
import re

import deepseek4_converted as ds4
import jax
import numpy as np
import pytest

from luce_jax import LLM, SamplingParams
from luce_jax.config import DEFAULT_DRAFT, EngineConfig

from hf_gguf import hf_to_gguf, make_hf_model

PROMPTS = [list(range(5, 45)), [30, 31, 32], [7] * 21, [100, 101, 102, 103, 104]]
SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# greedy rows (one with its top logprobs, taken from each device's part of the vocabulary)
# beside a seeded sampled one (top-k and top-p): its draws are the same too
SPS = [SP, SP, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5),
       SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.9, seed=7,
                      ignore_eos=True)]  # fmt: skip
# chunks of 16 prompt tokens: the 40-token prompt is prefilled over three steps beside decodes
ENGINE = dict(max_concurrency=2, max_ctx=96, prefill_chunk=16, prefill_token_budget=16,
              dtype="float32")  # fmt: skip


def run(path: str, **kw) -> tuple[list, LLM]:
    """Tokens of PROMPTS, all at once, with the third's top logprobs' ids and, last, their
    values (`same` compares those within 2e-4: a sum over split parts rounds differently),
    and the (still open) LLM."""
    llm = LLM(path, **{**ENGINE, **kw})
    before = llm.engine.runner.compiles
    outs = llm.generate(PROMPTS, SPS)
    alts = [alts for _, alts in outs[2].logprobs]
    out = [o.token_ids for o in outs] + [[[i for i, _ in a] for a in alts]]
    out.append(np.array([[v for _, v in a] for a in alts]))
    assert llm.engine.runner.compiles == before, "compiled while serving"
    return out, llm


def same(split: list, one: list) -> bool:
    return split[:-1] == one[:-1] and np.allclose(split[-1], one[-1], rtol=0, atol=2e-4)


ONE_DEVICE = {}  # (path, flags) -> one device's tokens


def same_as_one_device(path: str, **kw) -> LLM:
    """Assert the split engine's tokens equal one device's (same flags); return it open."""
    mesh_flags = ("tensor_parallel", "expert_parallel", "devices")
    alone = {k: v for k, v in kw.items() if k not in mesh_flags}
    key = (path, tuple(sorted(alone.items())))
    if key not in ONE_DEVICE:
        ONE_DEVICE[key], llm = run(path, **alone)
        llm.close()
        del llm
        gc.collect()  # the one-device engine's arrays go (the check of split weights sees none)
    split, llm = run(path, **kw)
    one = ONE_DEVICE[key]
    assert same(split, one), (kw, split, one)
    return llm


@pytest.fixture(scope="module")
def paths(tiny_models):
    return {arch: str(tiny_models[arch][1]) for arch in ("qwen3", "qwen3moe")}


def shard_shapes(x) -> list[tuple]:
    return [s.data.shape for s in x.addressable_shards]


def test_a_dense_model_split_over_two_and_four_devices_serves_one_devices_tokens(paths):
    """On two devices each holds half of each split weight and of the KV heads, and a
    compiled step moves no weight and no KV between devices (the attention runs on each
    device's heads, and the fused q|k|v and gate|up columns are stored so that each device's
    share is its own heads and FFN columns): its only collectives are the row-parallel
    projections' [T, d] sums, no collective-permute. The
    logits stay split by vocabulary into sampling, which gathers no [R, V] rows, also where a
    row samples under top-k / top-p / min-p. On four, the model's 2 KV
    heads are replicated and its 4 query heads split."""
    llm = same_as_one_device(paths["qwen3"], tensor_parallel=2)
    runner = llm.engine.runner
    lp = runner.params["layers"][0]
    d, qkv = lp["wqkv"].shape
    assert shard_shapes(lp["wqkv"]) == [(d, qkv // 2)] * 2  # column-parallel
    assert shard_shapes(lp["wo"]) == [(lp["wo"].shape[0] // 2, d)] * 2  # row-parallel
    kc = runner.kv[0][0]  # [NB, P, K, D]: each device holds half the KV heads
    NB, P, K, D = kc.shape
    assert shard_shapes(kc) == [(NB, P, K // 2, D)] * 2
    # no device holds a whole split weight besides its shard (the loader's copies are gone)
    whole = {x.shape for x in (lp["wqkv"], lp["wo"], runner.params["lm_head"])}
    for a in jax.live_arrays():
        assert not (len(a.devices()) == 1 and a.shape in whole), a.shape
    for T, S in runner.programs._exec:
        ops = collectives(runner.executable(T, S).as_text())
        assert set(ops) == {((T, d), "all-reduce")}, (T, S, ops)
    assert any(variant[2] for variant in runner.sample_programs._exec)  # filtered ones too
    for (R, S, filtered, logprobs, _), exe in runner.sample_programs._exec.items():
        gathered = [x for x in collectives(exe.as_text()) if x[0][-1:] == (runner.cfg.vocab_size,)]
        assert gathered == [], (R, S, filtered, logprobs, gathered)
    llm.close()
    llm = same_as_one_device(paths["qwen3"], tensor_parallel=4)
    kc = llm.engine.runner.kv[0][0]
    assert shard_shapes(kc) == [kc.shape] * 4
    llm.close()


@pytest.mark.parametrize("ep, backend", [(0, "pallas"), (1, "xla")])
def test_a_moe_model_splits_its_experts_or_their_width(paths, ep, backend):
    """By expert on the first two devices, the grouped-expert kernel (interpret mode) on each
    device's experts: a step's only gathers and sums are one [T, d] sum per layer for the
    attention output and one for the experts (no expert weight, routed row or logits row
    moves, and the fused q|k|v columns are each device's heads already). Or by FFN width
    on the devices asked for, XLA's grouped matmul partitioned."""
    devices = None if ep == 0 else (3, 1)
    llm = same_as_one_device(paths["qwen3moe"], tensor_parallel=2, expert_parallel=ep,
                             devices=devices, moe_backend=backend)  # fmt: skip
    runner = llm.engine.runner
    w = runner.params["layers"][0]["w_gu_exps"]  # [E, d, 2F]
    E, d, F2 = w.shape
    want = (E // 2, d, F2) if ep == 0 else (E, d, F2 // 2)
    assert shard_shapes(w) == [want] * 2
    assert {d.id for d in w.devices()} == set(devices or (0, 1))
    for T, S in runner.programs._exec if ep == 0 else ():
        ops = collectives(runner.executable(T, S).as_text())
        assert ops == [((T, d), "all-reduce")] * 2 * runner.cfg.n_layers
    llm.close()


def collectives(hlo: str) -> list[tuple[tuple, str]]:
    """(shape, op) of each all-gather, all-reduce, all-to-all and collective-permute."""
    ops = re.findall(
        r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|collective-permute)\(", hlo
    )
    return [(tuple(int(x) for x in shape.split(",")), op) for shape, op in ops]


def test_weights_load_straight_into_their_shards(paths, monkeypatch):
    """The accelerator that is JAX's default device (here CPU device 1) is a device of the
    mesh: the loader unpacks and fuses tensors on the host's device instead and sends each
    mesh device its shard, so no mesh device ever holds a split weight whole (as it would with
    everything loaded on the default device, then resharded). Each layer goes to the mesh as
    it is made, not the model at the end."""
    from luce_jax.device.mesh import Placement

    path, mesh = paths["qwen3"], (1, 2)
    one, llm = run(path)
    llm.close()
    devs = {jax.devices()[i] for i in mesh}
    whole_on_mesh, puts = [], []  # at each put: split leaves whole on a mesh device
    put = Placement.put

    def spy(self, tree, shardings):
        pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
        split = [x for x, s in pairs if not s.is_fully_replicated]
        whole_on_mesh.extend(x.shape for x in split if isinstance(x, jax.Array)
                             and x.sharding.is_fully_replicated and x.devices() & devs)  # fmt: skip
        puts.append(len(split))
        return put(self, tree, shardings)

    monkeypatch.setattr(Placement, "put", spy)
    jax.config.update("jax_default_device", jax.devices()[mesh[0]])
    try:
        split, llm = run(path, tensor_parallel=2, devices=mesh)
    finally:
        jax.config.update("jax_default_device", None)
    assert same(split, one)
    leaves = jax.tree.leaves(llm.engine.runner.params)
    assert all({d.id for d in x.devices()} == set(mesh) for x in leaves)
    assert not whole_on_mesh, whole_on_mesh
    layers = llm.engine.runner.cfg.n_layers
    assert len([n for n in puts if n]) >= layers, puts  # a layer at a time
    llm.close()


def test_a_hybrid_model_split_serves_one_devices_tokens(tmp_path):
    """The Gated DeltaNet layers split by head too (2 key heads, 4 value heads in llama.cpp's
    tiled order: each device holds a key head and the two value heads that read it): their
    projections, convolution and per-head params, and the slot state's conv channels and
    states, half on each device; the step moves none of them, and its only collectives are
    [T, d] sums. With prompt lookup on the device, the verify rows' stored proposal inputs
    split with the state, and their replay runs on each device's heads."""
    path = hf_to_gguf(make_hf_model("qwen35", seed=1), "qwen35", tmp_path / "qwen35.gguf")
    llm = same_as_one_device(str(path), tensor_parallel=2, spec_mode="ngram", draft_tokens=3)
    runner = llm.engine.runner
    lp = next(lp for lp in runner.params["layers"] if "w_in" in lp)
    for name, axis in {"w_in": 1, "conv": 0, "dt_bias": 0, "ssm_a": 0, "w_out": 0}.items():
        whole = list(lp[name].shape)
        whole[axis] //= 2
        assert shard_shapes(lp[name]) == [tuple(whole)] * 2, name
    conv, ssm = runner.state["model"]["conv"], runner.state["model"]["ssm"]
    assert shard_shapes(conv) == [(*conv.shape[:-1], conv.shape[-1] // 2)] * 2
    for pend in runner.state["model"]["pend"]:  # a layer's [S_max, K, W]
        assert shard_shapes(pend) == [(*pend.shape[:-1], pend.shape[-1] // 2)] * 2
    assert shard_shapes(ssm) == [(*ssm.shape[:2], ssm.shape[2] // 2, *ssm.shape[3:])] * 2
    d = runner.cfg.d_model
    for T, S in runner.programs._exec:
        ops = collectives(runner.executable(T, S).as_text())
        assert {shape for shape, op in ops if op != "all-reduce"} == set(), (T, S, ops)
        assert {shape for shape, _ in ops} == {(T, d)}, (T, S, ops)
    llm.close()


def test_a_quantized_hybrid_model_splits_its_gated_deltanet_heads(tmp_path):
    """Kept quantized (Q8_0; the input projection a quantized q|k|v|z part beside float beta
    and alpha parts), the Gated DeltaNet layers split by head as float ones do: each part of
    w_in by its rows, w_out by its input blocks (each device's value heads, in runs of whole
    32-value blocks), and the slot state by head; tokens equal one device's, and a step moves
    nothing but [T, d] sums."""
    from gguf import GGMLQuantizationType

    model = make_hf_model("qwen35", seed=2, linear_v_dim=32)
    path = hf_to_gguf(model, "qwen35", tmp_path / "q8.gguf", qtype=GGMLQuantizationType.Q8_0)
    llm = same_as_one_device(str(path), tensor_parallel=2, dtype="quantized")
    runner = llm.engine.runner
    lp = next(lp for lp in runner.params["layers"] if "w_in" in lp)
    qkvz, beta, alpha = lp["w_in"]
    N, d = qkvz.shape
    assert shard_shapes(qkvz.body) == [(N // 2, qkvz.body.shape[1])] * 2  # rows
    assert shard_shapes(qkvz.head) == [(qkvz.head.shape[0], N // 2)] * 2
    assert shard_shapes(beta) == shard_shapes(alpha) == [(d, beta.shape[1] // 2)] * 2
    w = lp["w_out"]  # [d, Hv*Dv]: its input blocks
    assert shard_shapes(w.body) == [(w.body.shape[0], w.body.shape[1] // 2)] * 2
    assert shard_shapes(w.head) == [(w.head.shape[0] // 2, w.head.shape[1])] * 2
    ssm = runner.state["model"]["ssm"]
    assert shard_shapes(ssm) == [(*ssm.shape[:2], ssm.shape[2] // 2, *ssm.shape[3:])] * 2
    for T, S in runner.programs._exec:  # one [T, d] sum a layer's mixer and one its FFN
        ops = collectives(runner.executable(T, S).as_text())
        assert ops == [((T, d), "all-reduce")] * 2 * runner.cfg.n_layers, (T, S, ops)
    llm.close()


def test_deepseek4_split_serves_transformers_tokens_and_batched_equals_alone():
    """DeepSeek V4 (the converter-made tiny model) over two devices: transformers' greedy
    tokens for its reference prompt (250 tokens: the decode closes a compressed entry), and
    PROMPTS batched as each alone, with nothing compiled after warmup."""
    ref = ds4.reference()
    llm = LLM(str(ds4.gguf()), tensor_parallel=2, max_concurrency=2, max_ctx=288,
              prefill_chunk=16, prefill_token_budget=16, dtype="float32", cache_type_k="f32",
              cache_type_v="f32")  # fmt: skip
    before = llm.engine.runner.compiles
    greedy = SamplingParams(max_tokens=len(ref["greedy"]), temperature=0)
    assert llm.generate([ref["prompt"].tolist()], greedy)[0].token_ids == ref["greedy"].tolist()
    batched = [o.token_ids for o in llm.generate(PROMPTS, SPS)]
    pairs = zip(PROMPTS, SPS, strict=True)
    assert batched == [llm.generate([p], sp)[0].token_ids for p, sp in pairs]
    assert llm.engine.runner.compiles == before
    llm.close()


def test_bad_parallel_settings_name_their_field():
    for kw, field in [
        (dict(tensor_parallel=0), "tensor_parallel"),
        (dict(tensor_parallel=2, expert_parallel=3), "expert_parallel"),
        (dict(tensor_parallel=2, devices=(0,)), "devices"),
        (dict(tensor_parallel=2, devices=(1, 1)), "devices"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}="):
            EngineConfig(**kw)
    with pytest.raises(ValueError, match="devices \\[9\\]"):  # at start: 4 local devices
        LLM(None, tensor_parallel=2, devices=(0, 9))
    with pytest.raises(ValueError, match="tensor_parallel=8: this process has 4"):
        LLM(None, tensor_parallel=8)


def test_placement_splits_each_weight_by_its_role():
    """Column-parallel weights split their outputs, row-parallel ones their inputs, experts
    their axis E (or width); a QuantWeight only by output rows, and no experts a Pallas kernel
    reads whole are split where that kernel does not run per device."""
    from jax import ShapeDtypeStruct as A

    from luce_jax.device.mesh import Placement, make_mesh
    from pallas_kernels.quant_weight import QuantWeight

    f = "float32"
    q = QuantWeight(head=A((8, 256), "uint16"), body=A((256, 256), "uint8"), qtype="q8_0")
    params = {"lm_head": A((64, 320), f), "embed": A((320, 64), f), "layers": [
        {"wqkv": A((64, 256), f), "bqkv": A((256,), f), "wo": A((128, 64), f),
         "attn_norm": A((64,), f), "w_gu_exps": A((8, 64, 96), f),
         "w_down_exps": A((8, 48, 64), f)},
        {"wqkv": q, "wo": q, "w_gu": A((64, 6), f), "w_down": A((3, 64), f)},
    ]}  # fmt: skip
    mesh = make_mesh(None, 2)

    def specs(**kw):
        tree = Placement(mesh, **kw).params(params)
        return jax.tree.map(lambda s: tuple(s.spec), tree)

    t = "tensor"
    s = specs(expert_parallel=True)
    assert s["lm_head"] == (None, t) and s["embed"] == ()
    a, b = s["layers"]
    assert (a["wqkv"], a["bqkv"], a["wo"], a["attn_norm"]) == ((None, t), (t,), (t, None), ())
    assert a["w_gu_exps"] == (t, None, None) and a["w_down_exps"] == (t, None, None)
    assert (b["wqkv"].head, b["wqkv"].body) == ((None, t), (t, None))  # output rows N
    assert b["wo"].body == () and b["w_down"] == ()  # 3 rows do not divide by 2: whole
    s = specs(expert_parallel=False)["layers"][0]  # the experts' width instead
    assert s["w_gu_exps"] == (None, None, t) and s["w_down_exps"] == (None, t, None)
    s = specs(expert_parallel=True, split_experts=False)["layers"]
    assert s[0]["w_gu_exps"] == () and s[1]["wqkv"].body == (t, None) and s[0]["wqkv"] == (None, t)
    # what one device holds (the KV pool is sized from it): split leaves' halves, the rest
    whole = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    split = Placement(mesh, expert_parallel=True, split_experts=False)
    kept = 8 * 256 * 2 + 256 * 256 + 3 * 64 * 4 + 320 * 64 * 4  # the row-parallel q, w_down, embed
    kept += 64 * 4 + (8 * 64 * 96 + 8 * 48 * 64) * 4  # attn_norm, the experts (whole)
    assert split.device_bytes(params) == kept + (whole - kept) // 2


def mixed_work(llm: LLM) -> list:
    """Greedy: a prompt, then a longer one sharing its first 64 tokens (served from the prefix
    cache), then a request beside one constrained by a JSON schema."""
    code = "import os\nimport sys\n\n\ndef read_lines(path):\n" * 6
    greedy = SamplingParams(max_tokens=16, temperature=0)
    first = llm.generate([code], greedy)[0]
    again = llm.generate([code + "    return"], greedy)[0]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rest = llm.generate(
        ["def add(a, b):\n", "import json\n"],
        [greedy, SamplingParams(max_tokens=24, temperature=0, json_schema=schema)],
    )
    assert again.cached_tokens >= 64, again.cached_tokens
    return [first.token_ids, again.token_ids, again.cached_tokens] + [o.text for o in rest]


def test_speculation_prefix_cache_quantized_kv_and_json_split_as_on_one_device():
    """The embedded draft model (a 4-layer model with the embedded model's tokenizer; 4 query
    heads, 2 KV heads), its Q8_0 weights kept quantized (split by rows), with q8_0 KV caches,
    over two devices with prompt lookup speculation: prefix cache hits and a JSON-constrained
    request, greedy tokens as one device's without speculation."""
    kw = dict(max_concurrency=2, max_ctx=192, prefill_chunk=32, prefill_token_budget=32,
              cache_type_k="q8_0", cache_type_v="q8_0", dtype="quantized")  # fmt: skip
    outs = []
    for tp in (1, 2):
        spec = {"spec_mode": "ngram"} if tp == 2 else {}
        llm = LLM(str(DEFAULT_DRAFT), tensor_parallel=tp, **kw, **spec)
        before = llm.engine.runner.compiles
        outs.append(mixed_work(llm))
        assert llm.engine.runner.compiles == before
        if tp == 2:  # the q8_0 caches' data and scales split by KV head, Q8_0 weights by rows
            data = llm.engine.runner.kv[0][0].data
            assert shard_shapes(data)[0][2] == data.shape[2] // 2
            body = llm.engine.runner.params["layers"][0]["wqkv"].body  # [N, bytes]
            assert shard_shapes(body) == [(body.shape[0] // 2, body.shape[1])] * 2
        llm.close()
    assert outs[0] == outs[1]
    assert outs[1][-1].startswith("{"), outs[1][-1]  # the schema's object, not code


def test_the_pallas_attention_kernels_run_on_each_devices_heads():
    """The paged attention and the fused norm/rope/KV-write kernels (interpret mode here)
    wrapped to run per device on split heads and caches compute what they compute whole."""
    import jax.numpy as jnp
    import numpy as np

    from luce_jax.device.mesh import Placement, make_mesh
    from luce_jax.device.sharded_kernels import _attention, _rope_write
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.rope_write import rope_write

    mesh = make_mesh(None, 2)
    place = Placement(mesh, expert_parallel=False)
    rng = np.random.default_rng(0)
    T, H, K, D, NB, P = 6, 4, 2, 32, 5, 4
    qkv = jnp.asarray(rng.standard_normal((T, (H + 2 * K) * D)), jnp.float32)
    kc, vc = (jnp.asarray(rng.standard_normal((NB, P, K, D)), jnp.float32) for _ in range(2))
    qw, kw = (jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32) for _ in range(2))
    ang = rng.uniform(0, 3, (T, D // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    write_idx = jnp.asarray([4, 5, 6, 8, 9, 10], jnp.int32)  # blocks 1 and 2
    kw_args = dict(heads=H, kv_heads=K, eps=1e-6, neox=True, out_dtype=jnp.float32)
    whole = rope_write(qkv, qw, kw, cos, sin, write_idx, kc, vc, **kw_args)
    split_caches = place.put((kc, vc), place.caches((kc, vc)))
    split = jax.jit(lambda *a: _rope_write(rope_write, mesh, 2, *a, **kw_args))(
        qkv, qw, kw, cos, sin, write_idx, *split_caches)  # fmt: skip
    for a, b in zip(whole, split, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    q, kc, vc = whole
    args = (jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32), jnp.asarray([0, 1, 2, 0, 1, 2], jnp.int32),
            jnp.asarray([[1, 0], [2, 0]], jnp.int32), jnp.asarray([3, 3], jnp.int32))  # fmt: skip
    kw_attn = dict(scale=D**-0.5, cu_q_lens=jnp.asarray([0, 3, 6], jnp.int32))
    want = paged_attention(q, kc, vc, *args, **kw_attn)
    got = jax.jit(lambda q, kc, vc: _attention(paged_attention, mesh, q, kc, vc, *args, **kw_attn))(
        q, *place.put((kc, vc), place.caches((kc, vc))))  # fmt: skip
    np.testing.assert_allclose(np.asarray(want), np.asarray(got), rtol=1e-5, atol=1e-5)


def test_the_quantized_matmul_kernels_run_on_each_devices_rows():
    """quant_matmul (interpret mode) wrapped to run per device on a QuantWeight split by its
    output rows computes what it computes whole: the decode call on int8 rows with its
    partials (splits), the plain call, and the prefill's dequantize-then-dot."""
    import functools

    import jax.numpy as jnp

    from luce_jax.device.mesh import Placement, make_mesh
    from luce_jax.device.sharded_kernels import _rows
    from pallas_kernels.dequantize import dequantized_matmul
    from pallas_kernels.int8_rows import int8_rows
    from pallas_kernels.quant_matmul import quant_matmul
    from pallas_kernels.quant_weight import QuantWeight

    mesh = make_mesh(None, 2)
    place = Placement(mesh, expert_parallel=False)
    rng = np.random.default_rng(0)
    T, N, K = 8, 128, 256
    w = QuantWeight.from_rows(random_q8_0(rng, N, K), "q8_0", "float32")
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
    split = place.put({"wqkv": w}, place.params({"wqkv": w}))["wqkv"]
    assert shard_shapes(split.body) == [(N // 2, w.body.shape[1])] * 2
    live = jnp.int32(3)
    x8 = int8_rows(x)
    calls = [
        (quant_matmul, (x, live), {}),
        (functools.partial(quant_matmul, int8_x=True), (x, live), {"x8": x8, "splits": True}),
        (dequantized_matmul, (x,), {}),
    ]
    for kernel, (xx, *rest), kw in calls:
        want = kernel(xx, w, *rest, **kw)
        per_device = functools.partial(_rows, kernel, mesh, 2, **kw)
        got = jax.jit(per_device)(xx, split, *rest)
        rows = slice(None) if not rest else slice(0, 3)  # past `live`: unspecified
        np.testing.assert_allclose(np.asarray(want)[..., rows, :], np.asarray(got)[..., rows, :],
                                   rtol=1e-5, atol=1e-4)  # fmt: skip
        assert got.sharding.spec[-1] == "tensor"  # the product stays split along N


def random_q8_0(rng, n: int, k: int) -> np.ndarray:
    """uint8 [n, k / 32 * 34]: Q8_0 rows of random codes, each block's fp16 scale first."""
    blocks = np.empty((n, k // 32, 34), np.uint8)
    blocks[..., :2] = rng.uniform(0.01, 0.05, (n, k // 32, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, (n, k // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(n, -1)
