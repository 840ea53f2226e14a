"""Token ids of a prompt that starts like a recent one: the shared part's ids reused, the rest
tokenized.

An agent loop resends an 8k-token prefix with a new tail each turn. Tokenizing it took 11 to
18 ms on the H200 host, a third of a warm request's time to first token once the prefix cache
supplies its KV (.dev note: 2026-12-01, in-process, random Qwen3-8B-shaped bf16).

Cutting is exact for byte-level BPE (tokenizer.ggml.model gpt2) whose split expressions end a
pre-token at every "letter, space, letter" (`CUT_SAFE`; tests/test_prefix_tokens.py checks
each against the pre-tokenizer on random text): BPE never merges across pre-tokens, so the ids
before such a space, well inside the shared text, are the ids the whole prompt would get
there, and the tail tokenizes alone from the space on. Byte-level tokens' input bytes add up
to the text's UTF-8 bytes, which locates the cut in the cached ids.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .pretokenizers import SPLITS

# Split types whose expressions end a pre-token at every space between two letters. Out:
# exaone_moe (its letter runs take a space before an upper-case letter: "é ΑΒΓ" is one
# pre-token) and superbpe (pre-tokens span spaces), found by the test on random text.
CUT_SAFE = frozenset(SPLITS) - {"exaone_moe", "superbpe"}
MIN_SHARED = 2048  # characters in common before reuse is worth a lookup
MARGIN = 256  # the cut stays this far inside the shared text (longer than any added token)


def codes(text: str) -> np.ndarray:
    """text's code points, uint32 [len(text)] (lone surrogates kept)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


def common_prefix(a: str | np.ndarray, b: str | np.ndarray) -> int:
    """Length of the longest common prefix of a and b (strings or their `codes`): one
    vectorized compare; halving with string slices copied 1.3 MB per 40k-character pair."""
    a, b = (codes(x) if isinstance(x, str) else x for x in (a, b))
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class _Recent:
    text: str
    ids: list[int]
    codes: np.ndarray
    ends: np.ndarray | None = None  # input bytes up to each id's end, made on first reuse


class PrefixTokens:
    """Remembers the last `size` long prompts and their ids; `encode` reuses the longest one
    the new prompt starts with.

    Args:
      encode: text -> ids, the tokenizer's own (no BOS / EOS added).
      input_bytes: per token id, the UTF-8 bytes of input text it stands for.
    """

    def __init__(self, encode: Callable[[str], list[int]], input_bytes: np.ndarray, size: int = 8):
        self._encode, self._bytes = encode, input_bytes
        self._recent: deque[_Recent] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.reused_tokens = 0  # ids taken from a recent prompt rather than tokenized

    def encode(self, text: str) -> list[int]:
        if len(text) < MIN_SHARED:
            return self._encode(text)
        with self._lock:
            recent = list(self._recent)
        mine = codes(text)
        best, shared = None, 0
        for entry in recent:
            n = common_prefix(entry.codes, mine)
            if n > shared:
                best, shared = entry, n
        ids = None
        if best is not None and shared >= MIN_SHARED:
            ids = self._reuse(best, text, shared)
        if ids is None:
            ids = self._encode(text)
        with self._lock:
            self._recent.append(_Recent(text, ids, mine))
        return list(ids)  # the caller's copy: the remembered list must not change

    def _reuse(self, entry: _Recent, text: str, shared: int) -> list[int] | None:
        """entry's ids up to a safe cut before `shared`, then the rest of text tokenized."""
        old, old_ids = entry.text, entry.ids
        p = _cut(old, shared - MARGIN)
        if p is None:
            return None
        if entry.ends is None:
            entry.ends = np.cumsum(self._bytes[np.asarray(old_ids, np.int64)])
        ends = entry.ends
        at = len(old[:p].encode("utf-8", "surrogatepass"))
        k = int(np.searchsorted(ends, at, side="right"))
        if k == 0 or ends[k - 1] != at:  # no token of the old prompt ends at the cut
            return None
        self.reused_tokens += k
        return old_ids[:k] + self._encode(text[p:])


def _cut(text: str, limit: int, window: int = 4096) -> int | None:
    """The last position p <= limit with a space at p between two letters, or None."""
    lo = max(1, limit - window)
    p = text.rfind(" ", lo, limit + 1)
    while p >= lo:
        if p + 1 < len(text) and text[p - 1].isalpha() and text[p + 1].isalpha():
            return p
        p = text.rfind(" ", lo, p)
    return None
