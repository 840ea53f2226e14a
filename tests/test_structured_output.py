"""Structured output: JSON schemas enforced token by token (xgrammar) on the embedded model,
through LLM.generate and the OpenAI API, beside unconstrained requests that stay unchanged."""

import json

import jsonschema
import pytest

from luce_jax import LLM, SamplingParams
from luce_jax.host.grammar import Grammars, check_schema

NAME = {"type": "string", "maxLength": 10}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    {"type": "object", "properties": {"id": SMALL}, "required": ["id"]},
    {"type": "boolean"},
    SMALL,
    {"type": "number", "minimum": -5, "maximum": 5},
    {"enum": ["red", "green", "blue"]},
    {"const": "ok"},
    {"type": "string", "maxLength": 8},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
    {
        "type": "object",
        "properties": {"name": NAME, "age": SMALL},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": NAME},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL, "y": SMALL},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"enum": ["start", "end"]},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 2}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"id": SMALL},
                "required": ["id"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {"anyOf": [SMALL, {"type": "boolean"}]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {
        "type": "object",
        "properties": {
            "kind": {"const": "call"},
            "args": {"type": "array", "items": SMALL, "maxItems": 2},
        },
        "required": ["kind", "args"],
        "additionalProperties": False,
    },  # fmt: skip
    {"type": "array", "prefixItems": [NAME, SMALL], "items": False},
    {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "pass": {"type": "boolean"},
        },
        "required": ["score", "pass"],
        "additionalProperties": False,
    },
]
PROMPTS = ["def parse(x):\n", "import json\n", "class Config:\n", "x = {", "# settings\n"]


@pytest.fixture(scope="module")
def llm(compile_cache):
    engine = LLM(max_concurrency=8, max_ctx=512, compile_cache_dir=compile_cache)
    yield engine
    engine.close()


def test_every_output_parses_and_matches_its_schema(llm):
    """20 schemas (objects, nesting, arrays, enums, bounded numbers, patterns, $ref, anyOf),
    greedy and sampled: each output is JSON that validates, ended by the grammar (stop)."""
    assert len(SCHEMAS) == 20
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    params = [
        SamplingParams(max_tokens=96, temperature=0.0 if i % 2 else 0.8, seed=i, json_schema=s)
        for i, s in enumerate(SCHEMAS)
    ]
    c0 = llm.engine.runner.compiles
    outs = llm.generate(prompts, params)
    assert llm.engine.runner.compiles == c0  # the masks are an input of every compiled step
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm):
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.token_ids for o in llm.generate(PROMPTS[:3], plain)]
    mixed = llm.generate(
        PROMPTS[:3] + PROMPTS[:3],
        [plain] * 3 + [SamplingParams(max_tokens=48, temperature=0, json_schema=SCHEMAS[10])] * 3,
    )
    assert [o.token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        jsonschema.validate(json.loads(o.text), SCHEMAS[10])
    assert not llm.engine.grammars.active  # finished requests leave no matcher behind


def test_constrained_requests_keep_the_asynchronous_loop(llm, monkeypatch):
    """The forward pass of a constrained step is launched before the step in flight is
    collected, so the device does not wait for the host between steps; its sampling (and
    mask) follows that collect, so each mask comes from the token before it."""
    runner, events = llm.engine.runner, []
    for name, code in (("launch_forward", "F"), ("launch_sample", "S"), ("fetch", "R")):
        f = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _f=f, _c=code: events.append(_c) or _f(*a))
    out = llm.generate(
        ["import json\n"], SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMAS[10])
    )[0]
    jsonschema.validate(json.loads(out.text), SCHEMAS[10])
    seq = "".join(events)  # the step in flight at the end may be collected after generate
    # Steady state: sample N, forward N + 1, then collect N. Collecting each step instead
    # would read forward N, sample N, collect N.
    assert seq.startswith("FSFR") and seq.count("SFR") >= len(out.token_ids) - 1, seq
    assert "FSR" not in seq[1:], seq


def test_a_deferred_sampling_that_raises_fails_only_its_step(llm, monkeypatch):
    """A constrained step's sampling is launched at a later dispatch; if that launch raises,
    the step's requests fail when it is collected, nothing leaks, and the next request runs."""
    runner, calls = llm.engine.runner, []
    real = runner.launch_sample

    def flaky(fwd, b):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected sampling failure")
        return real(fwd, b)

    monkeypatch.setattr(runner, "launch_sample", flaky)
    sp = SamplingParams(max_tokens=30, temperature=0, json_schema=SCHEMAS[10])
    out = llm.generate(["import json\n"], sp)[0]
    assert out.finish_reason == "error" and "injected" in out.error, out
    monkeypatch.undo()
    again = llm.generate(["import json\n"], sp)[0]
    jsonschema.validate(json.loads(again.text), SCHEMAS[10])
    engine = llm.engine
    assert engine.pool.available == engine.pool.capacity and not engine.grammars.active


def test_speculation_leaves_constrained_rows_unchanged(llm, compile_cache):
    """Proposals skip the grammar, so constrained rows verify none; with speculation on, a
    constrained request's greedy output is the one without it, beside a speculating row."""
    prompts = ["import json\n", "class Config:\n"]
    params = [
        SamplingParams(max_tokens=48, temperature=0, json_schema=SCHEMAS[12]),
        SamplingParams(max_tokens=24, temperature=0),
    ]
    want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = LLM(
        max_concurrency=2,  # the two requests; with the budget, few buckets to compile
        max_ctx=512,
        compile_cache_dir=compile_cache,
        spec_mode="ngram",
        prefill_chunk=16,
        prefill_token_budget=16,
    )
    try:
        got = spec.generate(prompts, params)
        verified = spec.engine.spec.stats()["verify_rows"]
    finally:
        spec.close()
    assert [o.token_ids for o in got] == want
    assert verified > 0  # the unconstrained row did speculate
    jsonschema.validate(json.loads(got[0].text), SCHEMAS[12])


def test_an_output_cut_by_max_tokens_ends_with_length(llm):
    out = llm.generate(
        ["x = "], SamplingParams(max_tokens=6, temperature=0, json_schema={"type": "array"})
    )[0]
    assert out.finish_reason == "length" and out.text.startswith("[")


def test_bad_schemas_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema="[1, 2]")
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema="{not json")
    with pytest.raises(ValueError, match="minProperties must be an integer"):
        check_schema(json.dumps({"type": "object", "minProperties": "x"}))
    g = Grammars([b"a", b"{", b"}", b""], [3], 4)
    with pytest.raises(ValueError, match="Unsupported type"):
        g.compile(json.dumps({"type": "nonsense"}))
