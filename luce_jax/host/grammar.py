"""Grammars: structured output (JSON schemas) constrained by xgrammar, one matcher per slot.

A constrained slot's next token is drawn only from those its grammar allows: before each step
the host fills a bitmask per constrained row (bit v of word v // 32 set: token v allowed) that
the step applies to the row's logits before sampling (device/sampling.py), and after the step
the matcher accepts the sampled token. The mask for a token depends on the token before it,
so a step with constrained rows launches its forward pass at once and its sampling once the
step before is collected (host/engine.py); rows without a grammar are unchanged.

Whitespace between JSON tokens is not free: with it, a model can pad with spaces and newlines
until max_tokens (the embedded model did, 50 of 60 tokens), so output is compact JSON, as
vLLM's `disable_any_whitespace` makes it.

xgrammar (and the torch it imports) is loaded on first use only: a server that never sees
`response_format` does not pay for it.
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np

from ..step_format import mask_words

log = logging.getLogger(__name__)

INSTALL_HINT = "structured output needs the xgrammar package (pip install 'luce-jax[structured]')"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(INSTALL_HINT) from e
    return xgrammar


def check_schema(schema: str) -> None:
    """Raise ValueError (with xgrammar's reason) unless `schema` (JSON text) is a JSON schema
    that xgrammar can turn into a grammar; needs no tokenizer, so the server checks requests
    before they queue."""
    xgr = _xgrammar()
    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except Exception as e:  # xgrammar raises RuntimeError with the converter's message
        raise _invalid(e) from e


def _invalid(e: Exception) -> ValueError:
    """xgrammar's reason, without its "[time] file.cc:line:" prefix."""
    reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip().splitlines()[-1])
    return ValueError(f"unsupported or invalid JSON schema: {reason}")


class Grammars:
    """Compiled grammars (cached by schema text) and the live slots' matchers.

    Args:
      token_bytes: the bytes each token id adds to the text (b"" for control tokens, which a
        grammar never allows).
      stop_ids: end-of-generation ids, allowed where the grammar is complete.
      vocab_size: V, the logits' width (token ids past the tokenizer's are never allowed).
    """

    def __init__(self, token_bytes: list[bytes], stop_ids, vocab_size: int):
        self._token_bytes = token_bytes
        self._stop_ids = sorted(stop_ids)
        self.vocab_size = vocab_size
        self._compiler = None
        self._matchers: dict[int, object] = {}  # slot -> xgrammar.GrammarMatcher
        self._printable = None  # [words] bitmask of tokens without control characters
        self._compiled: dict[tuple[str, str, str], object] = {}  # (schema, prefix, suffix)
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use

    @property
    def active(self) -> bool:
        return bool(self._matchers)

    def constrained(self, slot: int) -> bool:
        return slot in self._matchers

    def compile(self, schema: str, prefix: str = "", suffix: str = ""):
        """The compiled grammar of a JSON schema, between literal prefix and suffix texts
        (cached by all three).

        Raises:
          ValueError: xgrammar is missing or the schema cannot be compiled.
        """
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo(
                self._token_bytes,
                xgr.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        key = (schema, prefix, suffix)
        if key not in self._compiled:
            try:
                g = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            except Exception as e:
                raise _invalid(e) from e
            if prefix or suffix:  # a literal in EBNF is quoted and escaped as JSON text is
                lit = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(t)}") if t else None
                       for t in (prefix, suffix)]  # fmt: skip
                g = xgr.Grammar.concat(*(p for p in (lit[0], g, lit[1]) if p is not None))
            self._compiled[key] = self._compiler.compile_grammar(g)
        return self._compiled[key]

    def start(self, slot: int, req) -> None:
        """Constrain `slot` (just claimed) by its request's json_schema (and its prefix and
        suffix), if it has one (req: host/slot_owner.Admission). Raises ValueError as compile
        does."""
        sampling = req.sampling
        if sampling.json_schema is None:
            return
        g = self.compile(sampling.json_schema, sampling.json_prefix, sampling.json_suffix)
        self._matchers[slot] = _xgrammar().GrammarMatcher(g)

    def masks(self, slots: np.ndarray, sample: np.ndarray, S: int) -> np.ndarray | None:
        """Bitmasks int32 [S, words] for a step's rows (row i: slots[i], sampling where
        sample[i]); all bits set for rows without a grammar. None when no row samples under
        one, so the step takes its all-allowed default."""
        rows = [i for i, (s, smp) in enumerate(zip(slots.tolist(), sample.tolist(), strict=True))
                if smp and s in self._matchers]  # fmt: skip
        if not rows:
            return None
        out = np.full((S, mask_words(self.vocab_size)), -1, np.int32)
        filling, at = [], []
        for i in rows:
            m = self._matchers[int(slots[i])]
            if m.is_terminated():  # complete and its stop token taken: only stop tokens
                out[i] = 0
                for t in self._stop_ids:
                    out[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            else:
                filling.append(m)
                at.append(i)
        if filling:  # one call, the rows filled in parallel by xgrammar's threads
            if self._batch is None:
                self._batch = _xgrammar().BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(filling, out, at)
        for i in at:
            ok = out[i] & self.printable()
            if ok.any():  # else the grammar wants a control character: a literal's newline
                out[i] = ok
        return out

    def printable(self) -> np.ndarray:
        """Bitmask int32 [words] of the tokens with no byte below 0x20. xgrammar 0.2.9's JSON
        strings take control characters raw, which JSON forbids (Python's json.loads refused
        the tiny test model's output); compact JSON needs none outside strings, and inside
        them an escape is printable. Only where a grammar allows nothing printable (the
        newline of a literal around a tool call) do its control-character tokens stay."""
        if self._printable is None:
            ok = np.zeros(mask_words(self.vocab_size) * 32, bool)
            ok[: len(self._token_bytes)] = [all(c >= 0x20 for c in b) for b in self._token_bytes]
            self._printable = np.packbits(ok, bitorder="little").view(np.int32)
        return self._printable

    def accept(self, slot: int, tokens: list[int]) -> None:
        """Advance `slot`'s matcher over the tokens it sampled (a no-op for other slots)."""
        m = self._matchers.get(slot)
        if m is None:
            return
        for t in tokens:
            if m.is_terminated():
                break  # the stop token was accepted: the request ends with it
            if not m.accept_token(t):
                log.warning("slot %d: token %d outside its grammar", slot, t)

    def release(self, slot: int) -> None:
        self._matchers.pop(slot, None)
