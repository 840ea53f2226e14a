"""The public API: LLM(model=...).generate(prompts, sampling) -> list[Completion]."""

import pytest

from luce_jax import LLM, Completion, SamplingParams

from conftest import TINY_ENGINE


@pytest.fixture(scope="module")
def llm(tiny_gguf, compile_cache):
    with LLM(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE) as m:
        yield m


def test_generate_text_and_token_prompts(llm):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    text_out, ids_out = llm.generate(["the cat", llm.tokenizer.encode("the cat")], sp)
    assert isinstance(text_out, Completion)
    assert text_out.token_ids == ids_out.token_ids and len(text_out.token_ids) == 6
    assert text_out.text == llm.tokenizer.decode(text_out.token_ids)
    assert text_out.finish_reason == "length"


def test_per_prompt_sampling_and_stop_token(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = llm.generate("in a galaxy", greedy)[0]
    third = ref.token_ids[2]
    first = ref.token_ids.index(third)  # the stop token may also appear earlier
    stop = greedy.replace(stop_token_ids=(third,))
    a, b = llm.generate(["in a galaxy", "in a galaxy"], [greedy, stop])
    assert a.token_ids == ref.token_ids
    assert b.finish_reason == "stop" and b.token_ids == ref.token_ids[: first + 1]


def test_stop_string_is_not_returned(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = llm.generate("hello", greedy)[0]
    text = ref.text
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    out = llm.generate("hello", greedy.replace(stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]


def test_more_prompts_than_the_queue_holds_are_all_served(llm, monkeypatch):
    # the server refuses a request past max_queue; the offline API waits for a place instead
    monkeypatch.setattr(llm.scheduler, "max_queue", 1)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([f"prompt {i}" for i in range(7)], sp)
    assert [(o.error, o.finish_reason, len(o.token_ids)) for o in outs] == [(None, "length", 3)] * 7
    assert outs[4].token_ids == llm.generate("prompt 4", sp)[0].token_ids


def test_logprobs_are_returned_when_asked(llm):
    out = llm.generate("abc", SamplingParams(max_tokens=3, temperature=0, logprobs=5))[0]
    assert len(out.logprobs) == len(out.token_ids)
    lp, top = out.logprobs[0]
    assert top[0][0] == out.token_ids[0] and abs(top[0][1] - lp) < 1e-5 and lp <= 0
    assert all(len(t) == 5 for _, t in out.logprobs)  # as many alternatives as asked


def test_a_closed_llm_lets_its_device_arrays_go(tiny_gguf, compile_cache):
    """An engine's KV pool takes the device memory free at its start, so a closed LLM, even
    one still referenced, must hold none: its weights, caches and state are let go."""
    import jax

    def held():
        return sum(a.nbytes for a in jax.live_arrays())

    before = held()
    closed = LLM(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE)
    closed.generate("the cat", SamplingParams(max_tokens=2))
    assert held() - before > 100_000  # its weights and caches
    closed.close()
    assert held() - before < 100_000, held() - before


def test_bad_arguments_are_clear(llm, tiny_gguf):
    with pytest.raises(ValueError, match="sampling"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="logprobs=100"):
        SamplingParams(logprobs=100)  # OpenAI's and the HTTP API's limit is 20
    with pytest.raises(ValueError, match="temperature=5"):
        SamplingParams(temperature=5)  # the HTTP API's range, [0, 2]
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="max_concurrency"):
        LLM(model=tiny_gguf, max_concurrency=0)
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent.gguf")
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        LLM(model=tiny_gguf, attention_backend="flash")


def test_generate_cli_refuses_bad_flags_and_separates_outputs(monkeypatch, capsys):
    from luce_jax import generate

    for argv in (["--temperature", "5", "x"], ["--log-level", "bogus", "x"]):
        with pytest.raises(SystemExit) as e:
            generate.main(argv)
        assert e.value.code == 2

    class FakeLLM:
        def __init__(self, **kw):
            pass

        def generate(self, prompts, sp):
            return [Completion(f"out {p}", [], "length") for p in prompts]

        def close(self):
            pass

    monkeypatch.setattr(generate, "LLM", FakeLLM)
    assert generate.main(["a", "b"]) == 0
    assert capsys.readouterr().out == "--- 1: length ---\nout a\n--- 2: length ---\nout b\n"
    assert generate.main(["a"]) == 0
    assert capsys.readouterr().out == "out a\n"  # a single output needs no header


def test_startup_on_a_gpu_runs_each_bucket_once(tiny_gguf, compile_cache, caplog, monkeypatch):
    """Where the steps run on a GPU, start-up runs every bucket once before it is ready (and
    says so in its summary line); on CPU it does not (the line of the test below)."""
    import logging

    from luce_jax.device import bucket_runs
    from luce_jax.device.runner import Runner

    ran = []
    monkeypatch.setattr(Runner, "on_accelerator", property(lambda self: True))
    monkeypatch.setattr(bucket_runs, "first_runs", lambda runner, pairs: ran.append(list(pairs)))
    with caplog.at_level(logging.INFO, logger="luce_jax.build"):
        with LLM(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE) as llm:
            pairs = llm.engine.bucket_pairs()
    assert ran == [pairs]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in"))
    assert f"first runs 0.0 s ({len(pairs)} buckets)" in line


def test_startup_logs_where_its_time_went_and_a_restart_hits_the_compile_cache(
    llm, tiny_gguf, compile_cache, caplog
):
    """A second start with the same shapes and cache compiles nothing (every bucket comes from
    the persistent cache), runs no timing steps without speculation, and says so in one line."""
    import logging

    assert llm.engine.runner.step_time == {}  # no speculation: no steps timed at start-up
    with caplog.at_level(logging.INFO, logger="luce_jax.build"):
        with LLM(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE) as again:
            n = len(again.engine.bucket_pairs())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in"))
    assert "compile " in line and f"({n} buckets)" in line and "weights " in line
    assert "beside the compile" in line  # the weights load while the step compiles
    assert "first runs" not in line  # on CPU: nothing to gain
    hits, misses = (int(line.split(" hits, ")[0].split()[-1]),
                    int(line.split(" hits, ")[1].split()[0]))  # fmt: skip
    assert misses == 0 and hits >= n
