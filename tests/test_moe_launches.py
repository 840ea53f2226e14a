"""What a MoE layer's decode step launches, counted on CPU from the step lowered for CUDA.

Each Triton call is a kernel, and so, at most, is each XLA op that cannot fuse into an
elementwise neighbour (a reduction, a dot, a sort, a scatter, top-k, a loop). A 30B-A3B
decode step had made 25-29 kernels a layer, and the host's update of the step's CUDA graph
grows with them (bench/results/history/2026-12-02_profile_qwen3-30b-a3b-q4_k_m_int8_9ed94c9.md):
these bounds fail CI where a change adds launches to the MoE path."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from test_quantized_weights import SHAPES, load

from luce_jax.backends import served_quant_matmul
from luce_jax.device.runner import Runner
from luce_jax.models import moe
from luce_jax.models.family import Kernels
from luce_jax.models.linear import Normed, QuantMatmul
from luce_jax.step_format import GroupShape
from pallas_kernels.int8_rows import glu_int8_rows, norm_int8_rows
from pallas_kernels.moe_grouping import grouped_matmul
from pallas_kernels.moe_router import moe_router
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rope_write import rope_write

import make_model

TRITON = "__gpu$xla.gpu.triton"
# XLA ops that launch a kernel of their own (at most: XLA may fuse a reduction's producers)
LAUNCHING = ("reduce", "dot_general", "sort", "scatter", "while", "top_k", "custom_call")


def launches(text: str, entry: str) -> collections.Counter:
    """Launching ops of function `entry` of a lowered module, callees included."""
    bodies = {}
    for chunk in re.split(r"\n\s*func\.func ", text):
        m = re.match(r"(?:public |private )?@([\w$.]+)\(", chunk)
        if m:
            bodies[m.group(1)] = chunk

    @functools.cache
    def count(name: str) -> collections.Counter:
        body, out = bodies[name], collections.Counter()
        out["triton"] += body.count(f"custom_call @{TRITON}(")
        for op in re.findall(r"= (?:stablehlo|chlo)\.(\w+)", body):
            if op in LAUNCHING and op != "custom_call":
                out[op] += 1
        for callee in re.findall(r"call @([\w$.]+)\(", body):
            if callee in bodies:
                out += count(callee)
        return out

    return count(entry)


def gpu_kernels(router: str | None = "engine") -> Kernels:
    """The engine's kernels on a GPU (Triton, not interpret mode), int8 activations; the
    router: the engine's ("engine": XLA's dot, then the kernel), the one-kernel form ("fused")
    or XLA's ops (None)."""
    gpu = functools.partial
    return Kernels(
        gpu(paged_attention, interpret=False), gpu(grouped_matmul, interpret=False),
        QuantMatmul(gpu(served_quant_matmul, interpret=False, int8_x=True),
                    norm_int8=gpu(norm_int8_rows, interpret=False),
                    glu_int8=gpu(glu_int8_rows, interpret=False)),
        rope_write=gpu(rope_write, interpret=False),
        moe_router=router and gpu(moe_router, fused_dot=router == "fused", interpret=False),
    )  # fmt: skip


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory, tiny_gguf):
    path = str(tmp_path_factory.mktemp("launches") / "moe.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(make_model.SHAPES, "moe", SHAPES["moe"])
        make_model.write("moe", "q4_k_m", tiny_gguf, path)
    return load(path, True)[1:]


def test_a_decode_moe_ffn_is_seven_kernels(moe_file):
    """The FFN of a decode bucket (8 rows, quantized experts, int8 activations): the norm and
    its int8 rows, the router's dot and its kernel (scores, top-k, weights), gate | up, the
    GLU's int8 rows, down, and one reduction of the splits and a token's experts with the
    routing weights. No sort, top-k or scatter outside a kernel; the one-kernel router saves
    the dot, and XLA's routing costs more (backends.moe_router_fn says which the engine runs)."""
    cfg, params = moe_file
    lp = params["layers"][1]

    def lowered(router: str | None) -> str:
        k = gpu_kernels(router)

        def f(x, nw, live):
            h = Normed(x, nw, cfg.rms_eps)
            return moe.ffn(lp, h, cfg, k.grouped_matmul, live, k.quant_matmul, k.moe_router)

        args = (jnp.zeros((8, cfg.d_model), jnp.float32), lp["ffn_norm"], jnp.int32(3))
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    engine = launches(lowered("engine"), "main")
    assert engine == {"triton": 5, "dot_general": 1, "reduce": 1}, engine
    fused = launches(lowered("fused"), "main")
    assert fused == {"triton": 5, "reduce": 1}, fused
    xla = launches(lowered(None), "main")
    assert sum(xla.values()) > sum(engine.values()) + 1, xla
    assert xla["dot_general"] == 1 and xla["top_k"] == 1


def test_a_decode_moe_layer_stays_within_its_bound(moe_file):
    """The whole qwen3moe layer of a decode step (attention and FFN): at most 21 launches
    (routing by XLA's ops made 26 or more: the FFN test above counts the difference)."""
    cfg, params = moe_file
    runner = Runner(cfg, params, [GroupShape(9, 16, 8)], 4, (jnp.bfloat16, jnp.bfloat16),
                    gpu_kernels())  # fmt: skip
    fn, args = runner.step_function(8, 4)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    layers = re.findall(r"func\.func private @(layer(?:_\d+)?)\(", text)
    assert len(layers) >= 1
    counts = [sum(launches(text, name).values()) for name in layers]
    assert max(counts) <= 21 and min(counts) >= 10, counts  # attention and FFN are there
