"""Reusing a recent prompt's ids gives exactly the ids of tokenizing the whole prompt."""

import random

import pytest
from tokenizers import Regex, pre_tokenizers

from luce_jax.loading.gguf import GGUFFile
from luce_jax.loading.prefix_tokens import CUT_SAFE, MARGIN, MIN_SHARED, _cut, common_prefix
from luce_jax.loading.pretokenizers import SPLITS
from luce_jax.loading.tokenizer import GGUFTokenizer, GGUFVocab

PIECES = ["word", "Wörter", "日本語", "x", "ΑΒΓ", "naïve", "123", "4567", "3.14", "it's",
          "don't", " ", "  ", "\n", "\n\n", "\t", "!", "?!", "(", ")", "->", "==", "é", "😀",
          "<|im_start|>", "<|im_end|>", "_", "-", "'", '"', "CamelCase", "snake_case"]  # fmt: skip


def random_text(r: random.Random, n: int) -> str:
    return "".join(r.choice(PIECES) + (" " if r.random() < 0.6 else "") for _ in range(n))


def pieces(split: str, text: str) -> list[tuple[int, int]]:
    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(x), behavior="isolated") for x in SPLITS[split]]
    )
    return [span for _, span in pre.pre_tokenize_str(text)]


def cut_pieces_differ(split: str, trials: int = 30) -> int:
    """How many random prompt pairs get other pre-tokens when cut and tokenized in two."""
    r, bad = random.Random(split), 0
    for _ in range(trials):
        shared = random_text(r, 300)
        a, b = shared + random_text(r, 40), shared + random_text(r, 40)
        n = common_prefix(a, b)
        p = _cut(a, n - MARGIN)
        if p is None:
            continue
        whole = pieces(split, b)
        head = [s for s in pieces(split, a) if s[1] <= p]
        tail = [(s + p, e + p) for s, e in pieces(split, b[p:])]
        bad += head + tail != whole
    return bad


@pytest.mark.parametrize("split", sorted(CUT_SAFE))
def test_the_cut_is_a_pre_token_boundary_whatever_follows_the_shared_text(split):
    """For each split type reuse is on for: the pre-tokens of a prompt are the old prompt's
    before the cut and the tail's own after it, for texts diverging anywhere after the
    margin."""
    assert cut_pieces_differ(split) == 0


@pytest.mark.parametrize("split", sorted(set(SPLITS) - CUT_SAFE))
def test_the_split_types_left_out_do_fail_the_check(split):
    assert cut_pieces_differ(split) > 0


@pytest.fixture(scope="module")
def qwen2(fixtures_dir):
    f = GGUFFile(fixtures_dir / "tokenizers" / "ggml-vocab-qwen2.gguf")
    return GGUFTokenizer(GGUFVocab.from_metadata(f.metadata))


def test_agent_turns_reuse_the_prefix_and_get_the_whole_prompts_ids(qwen2):
    r = random.Random(0)
    prefix = random_text(r, 1500)
    assert len(prefix) > MIN_SHARED
    before = qwen2._prefix.reused_tokens
    for turn in range(6):
        prompt = prefix + random_text(r, 60 + 10 * turn)
        assert qwen2.encode(prompt) == qwen2._encode(prompt), turn
        prefix = prompt  # a conversation: each prompt extends the last
    assert qwen2._prefix.reused_tokens - before > 5 * 1000  # the later turns did reuse


def test_prompts_diverging_at_any_point_still_get_their_own_ids(qwen2):
    r = random.Random(1)
    base = random_text(r, 1200)
    for i in range(20):
        cut = r.randrange(len(base) // 2, len(base))
        prompt = base[:cut] + random_text(r, 30)
        assert qwen2.encode(prompt) == qwen2._encode(prompt), i


def test_a_cut_inside_a_word_would_change_the_ids(qwen2):
    """The control: tokenizing from a position that is not a pre-token boundary gives other
    ids, so the equality above is not automatic."""
    text = "internationalization " * 200
    p = text.index("national", 2000)
    assert qwen2._encode(text[:p]) + qwen2._encode(text[p:]) != qwen2._encode(text)
