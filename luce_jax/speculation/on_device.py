"""Proposals made and kept on the device (no jax): a draft head's, a draft model's, prompt
lookup's or an MTP block's.

With `--spec-mode head`, `mtp`, or `draft` or `ngram` where the family runs them on the device,
every sampling program that may feed a next verify row proposes K tokens per sampled row, right
after verification, and keeps them per slot on the device beside how many proposals the row
kept (device/proposals.py): the head from the row's hidden state (models/draft_head.py), the
draft model (and the MTP block, on the target's hidden states) with K decode steps over its own
KV, which the forward pass fed with the step's tokens, the lookup from a
token cache the forward pass wrote (device/ngram_lookup.py). A verify row then carries markers,
not tokens (step_format.proposal_from_device): the device feeds the slot's proposals and shifts
the row past the proposals its last step kept (sampling.catch_up). So proposing needs nothing
from the host, and steps overlap as without speculation: the host dispatches step N+1 before it
reads step N's tokens, and learns what was kept one step later."""

from __future__ import annotations

from ..step_format import proposal_from_device


class OnDeviceProposer:
    """The Proposer interface (ngram.Proposer) over proposals that stay on the device: every
    decoding slot has K of them (its last step sampled a token, and the proposer ran after it)."""

    on_device = True  # proposals are markers the device resolves; steps may overlap

    def start(self, slot: int, prompt: list[int], max_len: int = 0) -> None:
        pass

    def extend(self, slot: int, tokens: list[int]) -> None:
        pass

    def available(self, want: dict[int, int]) -> dict[int, int]:
        return dict(want)

    def propose(self, want: dict[int, int]) -> dict[int, list[int]]:
        return {slot: [proposal_from_device(j) for j in range(k)] for slot, k in want.items()}

    def drop(self, slot: int) -> None:
        pass
