"""GGUF tokenizers reproduce llama.cpp's test vectors; detokenization; chat templates."""

import copy
import functools

import pytest

from luce_jax.loading.gguf import GGUFFile
from luce_jax.loading.tokenizer import GGUFTokenizer, GGUFVocab

VOCABS = ["qwen2", "llama-spm"]


@functools.cache
def load(fixtures_dir, name, template=None) -> GGUFTokenizer:
    md = GGUFFile(fixtures_dir / "tokenizers" / f"ggml-vocab-{name}.gguf").metadata
    return GGUFTokenizer(GGUFVocab.from_metadata(md), template)


def vectors(fixtures_dir, name):
    base = fixtures_dir / "tokenizers" / f"ggml-vocab-{name}.gguf"
    texts = base.with_suffix(".gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    outs = base.with_suffix(".gguf.out").read_text("utf-8").split("\n")[:-1]
    assert len(texts) == len(outs) > 40
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs, strict=True)]


class WithoutBatchFast:
    """A tokenizers.Tokenizer as an older tokenizers release has it: no encode_batch_fast."""

    def __init__(self, hf):
        self.encode = hf.encode


@pytest.mark.parametrize("fast", [True, False], ids=["batch-fast", "plain-encode"])
@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(fixtures_dir, name, fast):
    tok = load(fixtures_dir, name)
    if not fast:  # a copy: load() is cached for the other tests
        tok = copy.copy(tok)
        tok.hf = WithoutBatchFast(tok.hf)
    for text, expected in vectors(fixtures_dir, name):
        assert tok.encode(text, add_special=False) == expected, repr(text)


@pytest.mark.parametrize("name", VOCABS)
def test_incremental_decode_is_valid_utf8_and_equals_full_decode(fixtures_dir, name):
    from luce_jax.loading.tokenizer import IncrementalDecoder

    tok = load(fixtures_dir, name)
    for text, _ in vectors(fixtures_dir, name):
        ids = tok.encode(text, add_special=False)
        dec = IncrementalDecoder(tok, strip_leading_space=True)
        parts = [dec.push(i) for i in ids] + [dec.flush()]
        assert all("\ufffd" not in p for p in parts) or "\ufffd" in text
        assert "".join(parts) == tok.decode(ids), repr(text)


def test_continuation_keeps_sentencepiece_leading_space(fixtures_dir):
    from luce_jax.loading.tokenizer import IncrementalDecoder

    tok = load(fixtures_dir, "llama-spm")
    ids = tok.encode("Hello world", add_special=False)
    dec = IncrementalDecoder(tok)  # a continuation of some prompt
    assert "".join(dec.push(i) for i in ids[1:]) == " world"


def test_bos_rules_from_metadata(fixtures_dir):
    spm = load(fixtures_dir, "llama-spm")  # add_bos_token = true
    assert spm.encode("Hello")[0] == spm.bos_id == 1
    assert spm.encode("Hello", add_special=False)[0] != 1
    qwen = load(fixtures_dir, "qwen2")  # no add_bos_token: llama.cpp's gpt2 default is off
    assert qwen.encode("Hello") == qwen.encode("Hello", add_special=False)


def test_special_tokens_are_parsed_and_end_generation(fixtures_dir):
    tok = load(fixtures_dir, "qwen2")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    im_start, im_end = tok.hf.token_to_id("<|im_start|>"), tok.hf.token_to_id("<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert im_end in tok.eog_ids and tok.eos_id in tok.eog_ids
    assert tok.decode(ids) == "user\nhi"  # control tokens are skipped in output text


MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Write a haiku about JAX."},
    ],
]


TEMPLATES = ["Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("messages", MESSAGES, ids=["user", "system+multi"])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_equals_transformers(fixtures_dir, template, messages, gen):
    from transformers import PreTrainedTokenizerFast

    source = (fixtures_dir / "chat_templates" / template).read_text()
    ours = load(fixtures_dir, "qwen2", source)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=ours.hf, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    hf.chat_template = source
    kwargs = {"date_string": "26 Jul 2024"} if "Llama" in template else {}
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs) == expected


@pytest.mark.parametrize("template", TEMPLATES)
def test_tools_and_tool_turns_render_as_transformers_does(fixtures_dir, template):
    """What the server passes a chat template for tool calling: `tools` (OpenAI shape), an
    assistant turn of tool_calls (arguments as an object) with empty content, and the tool's
    result."""
    from transformers import PreTrainedTokenizerFast

    source = (fixtures_dir / "chat_templates" / template).read_text()
    ours = load(fixtures_dir, "qwen2", source)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=ours.hf, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    hf.chat_template = source
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    kwargs = {"date_string": "26 Jul 2024"} if "Llama" in template else {}
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True, **kwargs)  # fmt: skip
    text = ours.apply_chat_template(messages, True, tools=tools, **kwargs)
    assert text == expected
    assert '"name": "add"' in text and '"a": 2' in text and "5" in text


def test_gguf_embedded_template_is_used(fixtures_dir):
    tok = load(fixtures_dir, "qwen2")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_pre_tokenizer_is_named():
    v = GGUFVocab(model="gpt2", pre="klingon", tokens=["a"], token_types=[1])
    with pytest.raises(ValueError, match="klingon"):
        GGUFTokenizer(v)


def test_every_supported_pre_tokenizer_gives_llama_cpps_ids(fixtures_dir):
    """Each `tokenizer.ggml.pre` name we accept splits text as llama.cpp 11434 does: the qwen2
    vocabulary tagged with each name tokenizes 61 texts to the ids llama.cpp gave
    (bench/peers/pre_vectors.py made tests/data/pre_tokenizer_vectors.json)."""
    import json
    from pathlib import Path

    from luce_jax.loading.pretokenizers import NAMES
    from luce_jax.loading.tokenizer import byte_level_splits

    data = json.loads((Path(__file__).parent / "data/pre_tokenizer_vectors.json").read_text())
    md = dict(GGUFFile(fixtures_dir / data["vocab"]).metadata)
    built, checked = {}, set()
    for group in data["groups"]:
        for name in group["names"]:
            split, ignore_merges, _ = NAMES[name]
            # one tokenizer per merge rule, built as serving builds it (0.5 s each for this
            # 151k-token vocabulary); the name's split rule swapped in as build_hf_tokenizer
            # sets it (the texts are under prefix_tokens.MIN_SHARED: no ids reused across swaps)
            if ignore_merges not in built:
                built[ignore_merges] = (
                    GGUFTokenizer(GGUFVocab.from_metadata(md | {"tokenizer.ggml.pre": name})),
                    split,
                )
            tok, built_split = built[ignore_merges]
            if split != built_split:
                tok.hf.pre_tokenizer = byte_level_splits(split)
                built[ignore_merges] = tok, split
            for text, ids in zip(data["texts"], group["ids"], strict=True):
                assert tok.encode(text, add_special=False) == ids, (name, text)
            checked.add(name)
    assert checked == set(NAMES) and len(NAMES) > 80


def test_pre_tokenizers_turn_bos_on_where_llama_cpp_does(fixtures_dir):
    md = dict(GGUFFile(fixtures_dir / "tokenizers" / "ggml-vocab-qwen2.gguf").metadata)
    assert not GGUFVocab.from_metadata(md).add_bos  # qwen2: off
    assert GGUFVocab.from_metadata(md | {"tokenizer.ggml.pre": "llama-bpe"}).add_bos
    off = md | {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False}
    assert not GGUFVocab.from_metadata(off).add_bos  # the file's own setting wins


def test_serve_refuses_an_unsupported_pre_tokenizer_before_starting(fixtures_dir, tmp_path, capsys):
    """A file whose `tokenizer.ggml.pre` we cannot split ends `serve` with status 2 naming the
    flag and the field, before anything loads."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench" / "peers"))
    from pre_vectors import retag

    from luce_jax.serve import parse_config

    bad = tmp_path / "klingon.gguf"
    retag(fixtures_dir / "tokenizers" / "ggml-vocab-qwen2.gguf", bad, "klingon")
    with pytest.raises(SystemExit) as e:
        parse_config(["--model", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "--model" in err and "tokenizer.ggml.pre 'klingon'" in err
