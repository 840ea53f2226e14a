"""Draft-head proposals: the ones the slot's last step made and kept on the device (no jax).

With `--spec-mode head` every sampling program runs the draft head (models/draft_head.py) from
each sampled row's hidden state and emitted token, and keeps its K proposals per slot on the
device, beside how many proposals the row kept (device/proposals.py). A verify row then
carries markers, not tokens (host.batch.proposal_from_device): the device feeds the slot's
proposals and shifts the row past the proposals its last step kept (sampling.catch_up). So
proposing needs nothing from the host, and steps overlap as without speculation: the host dispatches
step N+1 before it reads step N's tokens, and learns what was kept one step later.
"""

from __future__ import annotations

from ..host.batch import proposal_from_device


class HeadProposer:
    """The Proposer interface (ngram.Proposer) over proposals that stay on the device: every
    decoding slot has K of them (its last step sampled a token, and the head ran after it)."""

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
