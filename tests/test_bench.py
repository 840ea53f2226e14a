"""The benchmark tools: model files, roofline arithmetic, harnesses against a real server."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

BENCH = Path(__file__).resolve().parents[1] / "bench"
# The scripts run from their folders with bench/ on the path; imported here the same way.
sys.path[:0] = [str(BENCH / d) for d in ("", "peers", "serving", "kernels", "engine")]

import compare  # noqa: E402
import concurrency  # noqa: E402
import make_model  # noqa: E402
import profile_step  # noqa: E402
import retrieval  # noqa: E402
import roofline  # noqa: E402

TINY = dict(d=64, L=2, H=4, K=2, D=16, F=128, tied=False)
TINY_MOE = dict(TINY, E=8, k=2, Fe=32)


@pytest.fixture(scope="module")
def made(tmp_path_factory, fixtures_dir, monkeypatch_module):
    """Tiny dense (bf16) and MoE (q8_0) files written by make_model with the real qwen2 vocab."""
    monkeypatch_module.setitem(make_model.SHAPES, "tiny", TINY)
    monkeypatch_module.setitem(make_model.SHAPES, "tiny-moe", TINY_MOE)
    d = tmp_path_factory.mktemp("made")
    vocab = str(fixtures_dir / "tokenizers" / "ggml-vocab-qwen2.gguf")
    make_model.write("tiny", "bf16", vocab, str(d / "dense.gguf"))
    make_model.write("tiny-moe", "q8_0", vocab, str(d / "moe.gguf"))
    return d / "dense.gguf", d / "moe.gguf", vocab


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_made_models_have_real_shapes_and_tokenizer(made):
    dense, moe, vocab = made
    from luce_jax.loading.gguf import GGUFFile, model_config
    from luce_jax.loading.tokenizer import GGUFTokenizer

    cfg = model_config(GGUFFile(dense).metadata)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        64,
        2,
        4,
        2,
        16,
    )
    text = "def fibonacci(n):\n    return n"
    assert GGUFTokenizer.from_gguf(dense).encode(text) == GGUFTokenizer.from_gguf(vocab).encode(
        text
    )
    f = GGUFFile(moe)  # not gguf-py's reader: it spends 6-10 s on the 151k-token vocabulary
    assert f.metadata["general.architecture"] == "qwen3moe"
    assert f.metadata["qwen3moe.expert_count"] == 8
    t = f.tensors
    # numpy order (ggml's reversed): [E, Fe, d] for gate/up, [E, d, Fe] for down
    assert t["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert t["blk.1.ffn_down_exps.weight"].shape == (8, 64, 32)
    assert t["blk.0.ffn_up_exps.weight"].qtype.name == "Q8_0"


def test_q4_k_m_files_mix_types_as_llama_cpp_and_load(tiny_gguf, tmp_path, monkeypatch):
    """--type q4_k_m: Q6_K for the output head and for attn_v / ffn_down in the layers
    use_more_bits picks (of 8: 0, 3, 6, 7), Q4_K elsewhere; random K-quant blocks with small
    finite scales, so every tensor dequantizes to finite values of about the usual size."""
    import numpy as np

    from luce_jax.loading.gguf import GGUFFile, model_config
    from luce_jax.loading.params import load_params

    monkeypatch.setitem(make_model.SHAPES, "tiny-k", dict(d=256, L=8, H=4, K=2, D=64, F=512,
                                                         tied=False))  # fmt: skip
    vocab = tiny_gguf  # its 320 tokens: the types do not depend on the vocabulary
    path = str(tmp_path / "q4km.gguf")
    make_model.write("tiny-k", "q4_k_m", vocab, path)
    f = GGUFFile(path)
    types = {t.name: t.qtype.name for t in f.tensors.values()}
    more = [i for i in range(8) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert more == [0, 3, 6, 7] and more == [
        i for i in range(8) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"
    ]
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert {types[f"blk.{i}.{n}.weight"] for i in range(8) for n in ("attn_q", "ffn_up")} == {
        "Q4_K"
    }
    _, params = load_params(f, model_config(f.metadata), "float32")
    for x in (params["layers"][0]["w_down"], params["layers"][1]["w_down"], params["lm_head"]):
        x = np.asarray(x)
        assert np.isfinite(x).all() and 1e-4 < np.abs(x).mean() < 1.0


@pytest.mark.parametrize("type_name", ["q5_k", "iq4_xs"])
def test_k_quant_and_iq4_xs_files_load(tiny_gguf, tmp_path, monkeypatch, type_name):
    import numpy as np

    from luce_jax.loading.gguf import GGUFFile, model_config
    from luce_jax.loading.params import load_params

    monkeypatch.setitem(make_model.SHAPES, "tiny-k", dict(d=256, L=1, H=4, K=2, D=64, F=512,
                                                         tied=True))  # fmt: skip
    vocab = tiny_gguf
    path = str(tmp_path / f"{type_name}.gguf")
    make_model.write("tiny-k", type_name, vocab, path)
    f = GGUFFile(path)
    assert next(iter(f.tensors.values())).qtype.name == type_name.upper()
    _, params = load_params(f, model_config(f.metadata), "float32")
    assert np.isfinite(np.asarray(params["layers"][0]["wqkv"])).all()


def test_roofline_counts_every_weight_a_decode_step_reads(made):
    dense, moe, _ = made
    # Independent count with gguf's own reader: all tensors but the untied embedding table.
    r = GGUFReader(str(dense))
    want = sum(int(t.n_bytes) for t in r.tensors if t.name != "token_embd.weight")
    m = roofline.model_bytes(str(dense))
    c1 = roofline.decode_step(m, rows=1, ctx=100)
    assert c1.weight_bytes == want
    kv_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 kv heads, D 16, bf16
    assert c1.kv_bytes == 101 * kv_token
    c4 = roofline.decode_step(m, rows=4, ctx=100)
    assert c4.weight_bytes == want and c4.kv_bytes == 4 * c1.kv_bytes
    assert c4.flops == pytest.approx(4 * c1.flops)
    # Held as bf16 the q8_0 MoE file weighs more; its experts count by the share rows touch.
    mm = roofline.model_bytes(str(moe))
    assert mm.expert_elems == 3 * 2 * 8 * 32 * 64
    one = roofline.decode_step(mm, rows=1, ctx=0)
    many = roofline.decode_step(mm, rows=64, ctx=0)
    assert one.weight_bytes == pytest.approx(mm.dense_bytes + mm.expert_bytes * 2 / 8)
    assert (
        mm.dense_bytes + 0.99 * mm.expert_bytes
        < many.weight_bytes
        <= (mm.dense_bytes + mm.expert_bytes)
    )
    held = roofline.decode_step(mm, rows=1, ctx=0, held_bits=16)
    assert held.weight_bytes > one.weight_bytes


def test_retrieval_documents_are_deterministic_and_sized(made):
    from luce_jax.loading.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(made[2])

    def count(t):
        return len(tok.encode(t, add_special=False))

    for n in (1024, 4096):
        text, label = retrieval.document(n, seed=3, count=count)
        assert (text, label) == retrieval.document(n, seed=3, count=count)
        assert 0.95 * n <= count(text) <= n
        assert label in text[:200] and text.count(label) == 1
        assert text.endswith(retrieval.QUESTION)
    assert retrieval.document(1024, seed=4, count=count)[1] != label


def test_slot_groups_send_each_concurrency_to_the_smallest_server_that_fits():
    assert concurrency.slot_groups([1, 2, 4, 8, 16, 32], [8, 32]) == [
        (8, [1, 2, 4, 8]),
        (32, [16, 32]),
    ]
    assert concurrency.slot_groups([1, 5], None) == [(5, [1, 5])]
    with pytest.raises(ValueError, match="exceeds"):
        concurrency.slot_groups([64], [32])


def test_engine_decode_runs_an_engine_per_cache_type_and_maps_their_rates(tiny_gguf, tmp_path):
    """bench/engine/engine_decode.py --cache-types: one engine per type, every row named by its
    type, and the top-level tok_s {type: {C: tok/s}} that the KV-type results are recorded as."""
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(BENCH / "engine" / "engine_decode.py"), "--model", tiny_gguf]
    cmd += ["--ctx", "24", "--concurrency", "1", "2", "--steps", "2", "--warm", "1"]
    cmd += ["--budget", "32", "--dtype", "float32", "--cache-types", "bf16", "q8_0"]
    cmd += ["--copy-gib", "0.01", "--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, check=True, timeout=600, capture_output=True, env=env)
    res = json.loads(out.read_text())
    assert [(r["cache_type"], r["C"]) for r in res["rows"]] == [
        ("bf16", 1), ("bf16", 2), ("q8_0", 1), ("q8_0", 2)
    ]  # fmt: skip
    assert res["tok_s"] == {t: {str(r["C"]): r["tok_s"] for r in res["rows"] if r["cache_type"]
                                == t} for t in ("bf16", "q8_0")}  # fmt: skip
    assert all(v > 0 for rates in res["tok_s"].values() for v in rates.values())
    md = out.with_suffix(".md").read_text()
    assert "q8_0 KV | 2 |" in md and "vs xla, bf16 KV" in md  # ratios against the first type


def test_concurrency_harness_drives_fresh_servers(tiny_gguf, compile_cache, tmp_path):
    """Two slot groups: two fresh servers, each started with its {slots}."""
    out = tmp_path / "c.json"
    log = tmp_path / "server.log"
    server = (
        f"{sys.executable} -m luce_jax.serve --model {tiny_gguf} --port {{port}} "
        "--max-concurrency {slots} --max-ctx 512 --kv-pool-tokens 2048 --dtype float32 "
        "--cache-type-k f32 --cache-type-v f32 --prefill-token-budget 64 --prefill-chunk 64 "
        f"--compile-cache-dir {compile_cache} --log-level info"
    )
    cmd = [sys.executable, str(BENCH / "serving" / "concurrency.py"), "--server-cmd", server]
    cmd += ["--slot-groups", "1", "2", "--concurrency", "1", "2", "--waves", "2", "--reps", "1"]
    cmd += ["--max-tokens", "6", "--prompts", "3", "--out", str(out), "--server-log", str(log)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    res = json.loads(out.read_text())
    assert len(res["reps"]) == 1
    for rep in res["reps"]:
        assert [r["C"] for r in rep] == [1, 2]
        assert [r["tokens"] for r in rep] == [1 * 6 * 2, 2 * 6 * 2]  # ignore_eos: exact
    for row in res["summary"]:
        t = row["total_tok_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        assert row["ttft_median_s"]["median"] <= row["ttft_p95_s"]["median"]
    assert res["slot_groups"] == [1, 2]
    assert log.read_text().count("Started server process") == 2
    assert out.with_suffix(".md").read_text().count("\n| ") == 4
    assert out.with_suffix(".png").stat().st_size > 1000


def test_compare_ratio_table():
    def res(vals):
        return {
            "summary": [
                {
                    "C": c,
                    **{
                        k: {"median": v * s, "min": v * s * 0.9, "max": v * s * 1.1}
                        for k, s in (("total_tok_s", 1), ("window_tok_s", 1.1))
                    },
                    "ttft_median_s": {"median": 0.1, "min": 0.1, "max": 0.1},
                }
                for c, v in vals.items()
            ]
        }

    rows = compare.ratios(res({1: 200, 8: 900}), res({1: 100, 8: 600, 32: 1}))
    assert [r["C"] for r in rows] == [1, 8]
    assert [r["total_tok_s"]["ratio"] for r in rows] == [2.0, 1.5]
    md = compare.markdown(rows, "llama-server", "t", None)
    assert "**2.00x**" in md and "**1.50x**" in md
    # Output-window tok/s over the roofline: ours against bf16-held weights, the peer the file.
    roof = {1: {"file": 440, "held": 220}, 8: {"file": 3300, "held": 1650}}
    md = compare.markdown(rows, "llama-server", "t", roof)
    assert "| 440 / 220 | 100% / 25% |" in md
    # weights kept quantized (--dtype quantized): ours is held to the file's roofline too
    md = compare.markdown(rows, "llama-server", "t", roof, ours_holds="file")
    assert "| 440 / 220 | 50% / 25% |" in md and "ours on file" in md


def test_profile_attributes_step_time_to_model_parts(engine_config):
    from luce_jax.build import load_engine

    tok, engine = load_engine(engine_config)
    r = profile_step.profile(engine, tok, C=2, ctx=16, steps=2, warm=1)
    parts = r["parts_ms"]
    for part in ("qkv", "attention", "mlp", "lm_head", "sampling", "host + idle"):
        assert parts.get(part, 0) > 0, (part, parts)
    # Busy time is the union of kernel intervals: no more than their sum nor the step; the
    # host part is the rest of the step, so the parts cover the whole step.
    device = sum(v for k, v in parts.items() if k != "host + idle")
    assert r["device_busy_ms"] <= device * 1.001
    assert r["device_busy_ms"] <= r["step_ms"] * 1.001
    assert sum(parts.values()) >= r["step_ms"] * 0.999
    # kernels a step (the CUDA graph's size on a GPU) and the device's longest waits
    assert r["kernels_per_step"] > 10 and len(r["longest_waits_ms"]) <= 4
    # and per part: they add up to the step's, and the markdown has them as a column
    per_part = r["kernels_per_part"]
    assert abs(sum(per_part.values()) - r["kernels_per_step"]) < 1e-9 and per_part["mlp"] > 0
    table = profile_step.markdown([r], "t")
    assert "| kernels per step |" in table and f"| {per_part['mlp']:.0f} |" in table
    # each kernel's launches a step: the parts' kernels, counted by name
    launches = sum(k[3] for k in r["top_kernels_ms"])
    assert 0 < launches <= r["kernels_per_step"] + 1e-9 and "| launches per step |" in table


def test_kernel_ptx_reports_what_a_kernel_compiles_to_for_the_h200():
    """bench/kernels/kernel_ptx.py: Pallas's Triton module compiled for sm_90a on the CPU, with its
    registers and instructions (the tool for kernel work between GPU runs). The Q8_0 kernel,
    vector path included, converts no code with an I2F (an eighth of the FMA rate)."""
    import jax.numpy as jnp
    import kernel_ptx

    from pallas_kernels.quant_matmul import quant_matmul
    from pallas_kernels.quant_weight import QuantWeight

    w = QuantWeight.from_rows(jnp.zeros((64, 512 // 32 * 34), jnp.uint8), "q8_0")
    (ttir,) = kernel_ptx.triton_modules(
        lambda x: quant_matmul(x, w, jnp.int32(1), interpret=False),
        jnp.zeros((8, 512), jnp.bfloat16),
    )
    stats = kernel_ptx.compiled(ttir, num_warps=4, num_stages=2)
    assert stats["registers"] > 0 and stats["spill_bytes"] == 0
    assert any(k.startswith("ld.global") for k in stats["global_loads"])
    assert stats["sass"] > 0 and stats["I2F"] == 0, stats["sass_ops"]
    # ptxas takes the unit codes' inline PTX (ggml_asm.py), which no CPU test can run
    w = QuantWeight.from_rows(jnp.zeros((64, 512 // 256 * 144), jnp.uint8), "q4_k")
    (ttir,) = kernel_ptx.triton_modules(
        lambda x: quant_matmul(x, w, jnp.int32(1), unit_codes=True, interpret=False),
        jnp.zeros((8, 512), jnp.bfloat16),
    )
    stats = kernel_ptx.compiled(ttir, num_warps=4, num_stages=2)
    assert stats["sass_ops"].get("PRMT", 0) > 0 and stats["spill_bytes"] == 0


def test_kernel_ptx_accounts_for_the_moe_decode_kernels(monkeypatch, tmp_path):
    """`kernel_ptx.py moe`: the dense GEMV, the experts call and the router, each compiled
    for sm_90a with its registers, spills and SASS per weight byte, as a markdown table."""
    import kernel_ptx

    out = tmp_path / "moe.md"
    monkeypatch.setattr(sys, "argv", ["kernel_ptx.py", "moe", "--types", "q8_0", "--k", "512",
                                      "--n", "128", "--experts", "4", "--topk", "2",
                                      "--md", str(out)])  # fmt: skip
    kernel_ptx.main()
    rows = [r for r in out.read_text().splitlines() if r.startswith("| q8_0") or "router" in r]
    assert [r.split(": ")[0] for r in rows] == [
        "| q8_0 dense GEMV (1 live row)", "| q8_0 experts (2 pairs of a token)",
        "| router (4 experts, top 2)"]  # fmt: skip
    for r in rows:
        regs, spills, sass = (int(v) for v in r.split(" | ")[1:4])
        assert regs > 0 and spills == 0 and sass > 0


def test_kernel_ptx_compiles_one_path_when_asked(monkeypatch):
    """--vector keeps the vector path alone (dp4a, no matrix instructions), --dots the dots
    alone (int8 MMA with int8 dots, no dp4a): the two are counted apart."""
    import jax
    import jax.numpy as jnp
    import kernel_ptx

    from pallas_kernels.quant_matmul import quant_matmul
    from pallas_kernels.quant_weight import QuantWeight

    w = QuantWeight.from_rows(jnp.zeros((64, 512 // 256 * 144), jnp.uint8), "q4_k")
    ops = {}
    for vector in (True, False):  # a new function each time: jax caches a traced one
        f = lambda x: quant_matmul(x, w, jnp.int32(1), int8_x=True, int8_dots=True,  # noqa: E731
                                   vector_rows=1, interpret=False)  # fmt: skip
        monkeypatch.setattr(jax.lax, "cond", kernel_ptx.one_path(jax.lax.cond, vector))
        *_, ttir = kernel_ptx.triton_modules(f, jnp.zeros((8, 512), jnp.bfloat16))
        monkeypatch.undo()
        stats = kernel_ptx.compiled(ttir, num_warps=4, num_stages=2)
        ops[vector] = stats["sass_ops"] | stats["MMA"]
    assert "IDP" in ops[True] and not any("MMA" in o for o in ops[True]), ops[True]
    assert "IMMA" in ops[False] and "IDP" not in ops[False], ops[False]


def test_kernel_bench_variants_take_a_row_tile_and_int8_dots():
    """bench/kernels/quant_matmul.py's --variants: optional fifth to seventh fields set the
    programs, the row tile and the int8 dots (x's int8 rows times int8 codes) for every row."""
    import quant_matmul as qmm_bench

    plain = qmm_bench.parse_variant("64:256:4:2")
    assert plain == dict(block_n=64, values_per_step=256, num_warps=4, num_stages=2)
    assert qmm_bench.parse_variant("64:256:4:2:2112")["min_programs"] == 2112
    mmq = qmm_bench.parse_variant("128:256:8:3:264:128:1")
    assert mmq == dict(block_n=128, values_per_step=256, num_warps=8, num_stages=3,
                       min_programs=264, block_m=128, int8_x=True, int8_dots=True)  # fmt: skip
    assert "int8_dots" not in qmm_bench.parse_variant("128:256:8:3:264:128:0")


def test_kernel_bench_vector_variants_select_the_decoding():
    """bench/kernels/quant_matmul.py's --vector-variants: optional sixth to ninth fields turn on the
    unit codes, the int8 activations, the loads a step ahead and the int8 dots, so one device
    call can time every vector path."""
    import quant_matmul as qmm_bench

    unit = qmm_bench.parse_vector("32:1024:4:2:2112:1")
    assert unit == dict(block_n=32, values_per_step=1024, num_warps=4, num_stages=2,
                        vector_programs=2112, unit_codes=True, int8_x=False, prefetch=False,
                        int8_dots=False)  # fmt: skip
    plain = qmm_bench.parse_vector("64:256:4:2:2112")
    assert plain["unit_codes"] is False and plain["int8_x"] is False
    assert qmm_bench.parse_vector("64:256:4:2:2112:0:1")["int8_x"] is True
    ahead = qmm_bench.parse_vector("64:256:4:2:2112:0:1:1:1")
    assert ahead["prefetch"] is True and ahead["int8_dots"] is True


def test_kernel_bench_dequant_variants_take_the_transposed_layout():
    """bench/kernels/quant_matmul.py's --dequant: an optional fourth field writes W^T [K, N], and
    the variant's product is still x @ W^T."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import quant_matmul as qmm_bench

    from luce_jax.loading.quants import keep_quantized
    from pallas_kernels.dequantize import dequantized_matmul
    from pallas_kernels.ggml_blocks import FORMATS
    from pallas_kernels.quant_matmul import quant_matmul_reference

    from make_model import random_rows

    assert qmm_bench.parse_dequant("32:512:4") == dict(
        block_n=32, values_per_program=512, num_warps=4, transpose=False
    )
    kw = qmm_bench.parse_dequant("64:256:4:1")
    assert kw["transpose"] is True
    t = FORMATS["q4_k"].qtype
    w = keep_quantized(random_rows(40, 512, t, np.random.default_rng(0)), t, (40, 512), jnp.float32)
    x = jax.random.normal(jax.random.key(0), (3, 512), jnp.float32)
    got = dequantized_matmul(x, w, interpret=True, **kw)
    np.testing.assert_allclose(got, quant_matmul_reference(x, w), rtol=1e-5, atol=1e-4)


def test_int4_gemm_bench_splits_q4_k_into_scaled_codes_and_offsets():
    """bench/kernels/int4_gemm.py times Q4_K's dequantization split into a GEMM operand of convert
    and multiply (codes times group scales) and a product of the group offsets, also on a file's
    own Q4_K and Q8_0 blocks (Q4_K's nibbles in their order, x's columns permuted to it); on a
    tiny shape each product equals x times the weight dequantized in float32 (for the blocks:
    quant_matmul_reference) to bf16 rounding, and the compiled call's fusions are reported."""
    import int4_gemm

    r = int4_gemm.measure(16, "tiny", shapes={"tiny": (96, 512)}, layers=2)
    for kind in [*int4_gemm.VARIANTS, *int4_gemm.BLOCKS]:
        assert r[f"{kind}_rel_err"] < 1e-2 and r[f"{kind}_us"] > 0
        assert r[f"{kind}_compiled"]["fusions"] >= 1


def test_kernel_timing_gives_every_call_its_own_weights():
    """A variant with a weight-only part (dequantizing) is computed once per distinct buffer
    by XLA (the exp below: 2 for 6 calls over 2 buffers), so per_call wants a buffer per
    call and says so."""
    import re

    import jax
    import jax.numpy as jnp

    import timing

    fn = lambda x, w: x @ jnp.exp(w)  # noqa: E731

    def cycled(x, ws):
        for i in range(6):
            x = fn(x, ws[i % 2])
        return x

    ws = [jnp.full((4, 4), 0.1 * (i + 1)) for i in range(6)]
    hlo = jax.jit(cycled).lower(jnp.ones((2, 4)), ws[:2]).compile().as_text()
    assert len(re.findall(r"= f32\[4,4\]\S* exponential\(", hlo)) == 2
    with pytest.raises(ValueError, match="2 weight buffers for 6 calls"):
        timing.per_call(fn, jnp.ones((2, 4)), ws[:2], 6)
    assert timing.per_call(fn, jnp.ones((2, 4)), ws, 6, rounds=1, warmup_s=0) > 0


def test_kernel_timing_takes_the_median_of_its_rounds(monkeypatch):
    """bench/timing.per_call: after its warm-up, `rounds` rounds are timed and the median
    round's time per call is what a kernel bench reports (one short window had timed one
    kernel and grid 7 to 25% apart on the H200)."""
    import jax.numpy as jnp

    import timing

    seen, median = [], timing.statistics.median
    monkeypatch.setattr(timing.statistics, "median", lambda xs: seen.append(list(xs)) or median(xs))
    x, ws = jnp.ones((4, 8)), [jnp.ones((8, 8)) * i for i in range(3)]
    t = timing.per_call(lambda x, w: x @ w, x, ws, 3, rounds=5, round_s=0.001, warmup_s=0.01)
    assert len(seen) == 1 and len(seen[0]) == 5
    assert t == median(seen[0]) and 0 < t < 0.1


def test_attention_bench_counts_causal_work_and_checks_tilings_against_each_other(
    tmp_path, monkeypatch
):
    import attention_kernel

    # timing runs each variant 6 x LAYERS times, in interpret mode here: once is enough
    monkeypatch.setattr(attention_kernel, "LAYERS", 1)

    H, D = attention_kernel.H, attention_kernel.D
    # rows of a 2-token chunk at the end of 3 keys see 2 and 3 keys; a decode row at 5 sees 5
    assert attention_kernel.attention_flops([(2, 3), (1, 5)]) == 4.0 * (2 + 3 + 5) * H * D
    # a prompt chunk without XLA's path: every tiling is compared with the first one
    rows = attention_kernel.run_case(
        "prefill 20 @40",
        [(20, 40)],
        1e9,
        True,
        "bf16",
        [(16, 64, 4, 16, 0, 0), (16, 64, 4, 32, 1, 0), (16, "n3", 4, 16, 0, 0)],
        False,
    )
    assert [(r["block_qg"], r["split_masks"]) for r in rows] == [(16, False), (32, True)] + [
        (16, False)
    ]
    assert attention_kernel.variant("64:256:4") == (64, 256, 4, 64, 0, 0)
    assert attention_kernel.variant("64:256:4:128:1") == (64, 256, 4, 128, 1, 0)
    assert attention_kernel.variant("64:256:4:64:1:2") == (64, 256, 4, 64, 1, 2)
    assert attention_kernel.variant("64:n16:4") == (64, "n16", 4, 64, 0, 0)  # 16 splits a block
    with pytest.raises(argparse.ArgumentTypeError, match="split 'nx'"):
        attention_kernel.variant("64:nx:4")
    assert rows[0]["max_diff_vs_xla"] == 0.0  # the first variant is the baseline
    for r in rows[1:]:
        assert r["max_diff_vs_xla"] < 2e-2 and r["max_diff_vs_f32_ref"] < 2e-2
    # a variant's pieces reach the kernel, which refuses 3 dots for q8_0's 4 planes
    q8 = [(16, 64, 4, 16, 1, 3)]
    (row,) = attention_kernel.run_case("decode 1x40", [(1, 40)], 1e9, False, "q8_0", q8, False)
    assert row["pieces"] == 3 and "pieces 3" in row["error"]


def test_gated_delta_bench_times_two_forms_that_compute_the_same(tmp_path, monkeypatch):
    """bench/kernels/gated_delta_kernel.py (at toy sizes): the served in-place kernel and the former
    gather-kernel-scatter path give the same outputs and state, and the run writes a row per
    case and form with the live states' bytes."""
    import gated_delta_kernel as gd
    import jax.numpy as jnp
    import numpy as np

    for name, value in dict(LAYERS=3, SLOTS=4, Hv=4, Hk=2, D=32).items():
        monkeypatch.setattr(gd, name, value)
    x, cu, slots, fresh = gd.case_inputs([1, 5], 8)
    assert list(np.asarray(slots)[2:]) == [-1] * 6  # the bucket's padding rows
    state = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 4, 32, 32)), jnp.float32)
    kw = dict(chunk=0, num_warps=4)
    o1, s1 = gd._in_place(x, state, jnp.int32(1), slots, fresh, cu, block_v=16, **kw)
    o2, s2 = gd.gathered(x, state, jnp.int32(1), slots, fresh, cu, block_v=32, **kw)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s1, s2, rtol=1e-5, atol=1e-5)
    assert not np.allclose(s1, state)
    monkeypatch.setattr(gd, "copy_bandwidth", lambda: 1e11)
    out = tmp_path / "gd.json"
    argv = ["gd", "--variants", "0:16:4", "--decode", "1", "--prefill", "4", "--layers", "2"]
    monkeypatch.setattr(sys, "argv", argv + ["--out", str(out)])
    gd.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["form"]) for r in rows] == [
        ("decode 1 rows", "in place"), ("decode 1 rows", "gathered"),
        ("prompt chunk 4", "in place"), ("prompt chunk 4", "gathered"),
    ]  # fmt: skip
    assert all(r["us"] > 0 and r["GBs"] > 0 for r in rows)


def test_backend_tokens_reports_where_pallas_and_xla_part_and_the_top_two_there(made):
    """bench/kernels/backend_tokens.py: a run gives each prompt's greedy tokens with two logprobs a
    token and puts the engine's gated delta form back after it; a pair that parts is reported
    at its first differing token with each side's two best logprobs there. (That the Pallas
    kernels give the references' tokens is test_paged_attention's and test_hybrid_model's.)"""
    import backend_tokens as bt

    from luce_jax import backends
    from luce_jax.llm import Completion

    dense, _, _ = made
    default = backends.gated_delta_fn
    (out,) = bt.run(str(dense), "xla", 16, bt.PROMPTS[:1], 3)
    assert backends.gated_delta_fn is default
    assert len(out.token_ids) == 3 and all(len(top) == 2 for _, top in out.logprobs)
    assert bt.compare([out], [out]) == [{"same": True}]
    a = Completion("", [1, 2, 3], "length", logprobs=[(0, [(1, 0)])] * 3)
    tops = [(0, [(1, -0.1), (5, -0.2)])] * 2 + [(0, [(7, -0.3), (3, -0.4), (9, -2.0)])]
    b = Completion("", [1, 2, 7], "length", logprobs=tops)
    (row,) = bt.compare([a], [b])
    assert row["first_difference"] == 2 and row["xla_top2"] == [(7, -0.3), (3, -0.4)]


def test_dispatch_cost_times_launches_by_argument_count(tmp_path):
    """bench/engine/dispatch_cost.py: one row per case and donation, each a positive launch time."""
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(BENCH / "engine" / "dispatch_cost.py"), "--cases", "2:0", "2:3"]
    subprocess.run(
        [*cmd, "--out", str(out)], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["weights"], r["caches"], r["donated"]) for r in rows] == [
        (2, 0, False), (2, 3, False), (2, 3, True)
    ]  # fmt: skip
    assert all(r["launch_ms"] > 0 for r in rows)


def test_a_new_record_moves_the_one_it_replaces_into_history(tmp_path):
    """bench/results/ keeps one record a table: writing `results/<table>.json` again moves the
    earlier json and md into results/history/ under the earlier run's date; runs brought back
    from the device become records the same way (`meta.py keep`)."""
    import meta

    results = tmp_path / "results"
    results.mkdir()
    out = str(results / "compare_x.json")
    meta.write_result({"date": "2026-11-30", "rate": 1}, "first\n", out)
    meta.write_result({"date": "2026-12-05", "rate": 2}, "second\n", out)
    assert json.loads((results / "compare_x.json").read_text())["rate"] == 2
    assert (results / "compare_x.md").read_text() == "second\n"
    old = results / "history" / "2026-11-30_compare_x"
    assert json.loads(old.with_suffix(".json").read_text())["rate"] == 1
    assert old.with_suffix(".md").read_text() == "first\n"

    device = tmp_path / "res"
    device.mkdir()
    (device / "compare_x.json").write_text(json.dumps({"date": "2026-12-06", "rate": 3}))
    (device / "compare_x.png").write_bytes(b"png")
    meta.keep([str(device / "compare_x.json")], results)
    assert json.loads((results / "compare_x.json").read_text())["rate"] == 3
    assert (results / "compare_x.png").exists() and not (results / "compare_x.md").exists()
    assert (results / "history" / "2026-12-05_compare_x.md").read_text() == "second\n"
    # a writer outside a results folder (a scratch --out) moves nothing
    meta.write_result({"rate": 4}, "x\n", str(tmp_path / "scratch.json"))
    meta.write_result({"rate": 5}, "y\n", str(tmp_path / "scratch.json"))
    assert not (tmp_path / "history").exists()


def test_a_kernel_name_in_two_programs_keeps_the_first_programs_part():
    """The forward pass's HLO comes first in a profile's text: a name the sampling program
    reuses is attributed to the forward's part, not overwritten by sampling's."""
    fwd = '  %input_reduce_fusion = f32[8] fusion(%p), metadata={op_name="jit(f)/mlp/reduce"}'
    smp = '  %input_reduce_fusion = f32[8] fusion(%q), metadata={op_name="jit(s)/sampling/x"}'
    cats = profile_step.hlo_categories("\n".join([fwd, smp]))
    assert cats == {"input_reduce_fusion": "mlp"}
    assert profile_step.hlo_categories(smp) == {"input_reduce_fusion": "sampling"}
