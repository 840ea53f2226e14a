"""Prompt-lookup proposals: continue a sequence the way its own earlier text continued (no jax).

The proposer keeps, per slot, an index from each n-gram (n_min..n_max) of the sequence (prompt
and output) to where it last ended and where it ended the time before. To propose, it takes
the sequence's last n tokens, longest n first, finds their previous occurrence, and proposes
the up to k tokens that followed it there (as llama.cpp's lookup decoding and vLLM's
`ngram` speculator do). Index upkeep is O(n_max) per token, lookup O(n_max), so long
contexts cost nothing per step.

Proposers share one small interface (start, extend, available, propose, drop); the engine holds
proposals made on the device (on_device.py) behind the same calls. This one serves a family
whose slots are fed their kept proposals again (the host must know them), and is the
reference the device's lookup (device/ngram_lookup.py) is tested against.
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    """Speculative proposals per slot; the engine calls it with slots it owns."""

    def start(self, slot: int, prompt: list[int], max_len: int) -> None:
        """A slot was admitted; its sequence will hold at most max_len tokens."""

    def extend(self, slot: int, tokens: list[int]) -> None:
        """Tokens the slot's sequence accepted (after the prompt, in order)."""

    def available(self, want: dict[int, int]) -> dict[int, int]:
        """How many of want[slot] proposals each slot can have this step."""

    def propose(self, want: dict[int, int]) -> dict[int, list[int]]:
        """Up to want[slot] proposed tokens per slot (called once per engine step)."""

    def drop(self, slot: int) -> None:
        """The slot was retired."""


class _Index:
    """One sequence's tokens and, per n-gram, its last two end positions."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.prev: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(self.tokens[end - n : end])
                if key in self.last:
                    self.prev[key] = self.last[key]
                self.last[key] = end

    def propose(self, k: int) -> list[int]:
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            at = self.prev.get(tuple(self.tokens[end - n : end]))
            if at is not None:  # the suffix occurred before, ending at `at`: continue from there
                return self.tokens[at : at + k]
        return []


class NgramProposer:
    """Prompt lookup over each slot's own prompt and output.

    Args:
      n_min, n_max: n-gram lengths tried, longest first (a longer match is a better predictor).
    """

    def __init__(self, n_min: int = 1, n_max: int = 3):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max: {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._slots: dict[int, _Index] = {}

    def start(self, slot: int, prompt: list[int], max_len: int = 0) -> None:
        """Index a newly admitted slot's prompt (replacing whatever the slot held before)."""
        self._slots[slot] = _Index(self.n_min, self.n_max)
        self._slots[slot].extend(prompt)

    def extend(self, slot: int, tokens: list[int]) -> None:
        """Append tokens the slot's sequence has accepted."""
        self._slots[slot].extend(tokens)

    def available(self, want: dict[int, int]) -> dict[int, int]:
        return {slot: len(p) for slot, p in self.propose(want).items()}

    def propose(self, want: dict[int, int]) -> dict[int, list[int]]:
        """Up to want[slot] tokens per slot; an empty list where the suffix never occurred."""
        return {slot: self._slots[slot].propose(k) if k > 0 else [] for slot, k in want.items()}

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)
