"""Overlapped steps and rollback after speculation never leak or corrupt KV blocks (property
test, no model).

A fake runner plays the device: it writes each fed token id where batch.lower says the K/V
of that position goes, and samples tokens from a tiny vocabulary, so proposals are accepted
to random lengths. The scheduler runs random arrivals, stop tokens and cancellations, without
speculation (each step collected one step after its dispatch, so finished and cancelled
requests get an extra step computed) and with it. After every step each live sequence's cache
must hold exactly its prompt and delivered tokens up to its kv length, and no block may be
lost. As a hybrid model's device, the runner also
keeps per slot the tokens its recurrent state has absorbed (reset on a fresh row, advanced
through each row but its proposals): every row must start where its slot's state stands, and
the state must hold exactly the sequence up to there; with proposals on the device it replays
instead (models/gated_deltanet.py): a verify row's proposals wait in the slot, and its next row
first absorbs the ones the row kept. As a draft head's device, it keeps each
slot's proposals and the count its last row kept, feeds the proposal markers of verify rows and
moves rows lowered behind their slot's step in flight (steps overlap in that mode). As a draft
model's device (mode device-draft), it also keeps the draft's cache on the target's block ids:
every fed token is written there too, and each sampled row's K decode steps write the row's
last token and its first K - 1 proposals after it, inside blocks the host claimed unless past
the slot's reservation; that cache must hold the sequence as exactly as the target's. As
prompt lookup's device (device-ngram), it keeps a token cache on those block ids, written with
every fed token, which must hold the sequence as exactly too.
"""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from luce_jax.config import EngineConfig
from luce_jax.host.engine import StepEngine
from luce_jax.host.request import Request
from luce_jax.host.scheduler import Scheduler
from luce_jax.sampling_params import SamplingParams
from luce_jax.speculation.ngram import NgramProposer
from luce_jax.speculation.on_device import OnDeviceProposer
from luce_jax.speculation.policy import SpecPolicy
from luce_jax.speculation.speculator import Speculator
from luce_jax.step_format import FROM_DEVICE, GroupShape, lower

VOCAB = 5  # small, so prompt lookup finds matches and proposals are often right


class FakeRunner:
    """Runner.launch / fetch over a token-id 'cache'; samples at random. Like the device, it
    keeps each slot's last emitted token and feeds it to rows that ask for it (FROM_DEVICE)."""

    def __init__(self, num_blocks, block_size, max_slots, k, rng, recurrent=False, head=False,
                 draft=False, lookup=False):  # fmt: skip
        self.cfg = SimpleNamespace(recurrent=(True,) if recurrent else ())
        # as models/family.py declares it: a recurrent state is rolled back by feeding again, or
        # with proposals on the device by replaying the kept ones at the slot's next row
        self.replay = recurrent and (draft or lookup)
        rollback = "replay" if self.replay else "refeed" if recurrent else "kv_length"
        self.family = SimpleNamespace(rollback=rollback)
        self.pend = {s: [] for s in range(max_slots)}  # a replaying slot's stored proposals
        # A draft head: each sampled row leaves K proposals and its kept count on the device,
        # and later rows read them (markers) and move on by them (behind), as sampling.py does.
        # A draft model on the device does the same, and writes its own cache (dkv).
        self.head = head or draft or lookup
        self.draft, self.lookup = draft, lookup
        self.writes_ahead = k if draft else 0
        self.dkv = np.full(num_blocks * block_size, -1, np.int64)
        self.slots = None  # the engine's SlotTable (device-draft: where reservations end)
        self.acc = np.zeros(max_slots, np.int64)
        self.props = np.zeros((max_slots, max(k, 1)), np.int64)
        self.state = {s: [] for s in range(max_slots)}  # tokens each slot's state absorbed
        self.kv = np.full(num_blocks * block_size, -1, np.int64)
        self.last = np.zeros(max_slots, np.int64)
        self.block_size, self.max_slots, self.k, self.rng = block_size, max_slots, k, rng
        self.spaces = (GroupShape(num_blocks, block_size, num_blocks),)  # tables as wide as all
        self.shape = self.spaces[0]

    def logit_width(self, T, S):
        return S if self.k == 0 else min(T, S * (self.k + 1))

    def launch(self, b, T, S):
        n_tok = b["cu_q_lens"][-1]
        fed = b["tokens"][:n_tok].astype(np.int64)
        tok_slot = b["slots"][b["seg_ids"][:n_tok]]
        from_device = fed == FROM_DEVICE
        fed[from_device] = self.last[tok_slot[from_device]]
        marker = fed <= -2
        assert self.head or not marker.any(), "proposal markers need a draft head"
        fed[marker] = self.props[tok_slot[marker], -2 - fed[marker]]
        off = np.where(b["behind"] > 0, self.acc[np.maximum(b["slots"], 0)], 0)
        assert self.head or not off.any()
        seg = b["seg_ids"][:n_tok]
        pos = b["positions"][:n_tok] + off[seg]
        P = self.block_size
        write = np.where(off[seg] > 0, b["block_tables"][seg, pos // P] * P + pos % P,
                         b["write_idx"][:n_tok])  # fmt: skip
        assert (write[off[seg] > 0] >= P).all(), "a moved row writes outside its blocks"
        self.kv[write] = fed
        if self.draft or self.lookup:
            self.dkv[write] = fed
        n = int((b["slots"] >= 0).sum())
        if self.cfg.recurrent:
            for i in range(n):
                slot, lo, hi = b["slots"][i], b["cu_q_lens"][i], b["cu_q_lens"][i + 1]
                if b["fresh"][i]:
                    self.state[slot], self.pend[slot] = [], []
                elif self.replay:  # first the proposals its last verify row kept
                    self.state[slot] += self.pend[slot][: self.acc[slot]]
                assert pos[lo] == len(self.state[slot]), "row starts off its state"
                keep = hi - b["n_draft"][i]
                self.state[slot] += fed[lo:keep].tolist()
                self.pend[slot] = fed[keep:hi].tolist()
        R = self.logit_width(T, S)
        tokens = np.array([self.rng.randrange(VOCAB) for _ in range(R)])
        accepted = np.zeros(S, np.int64)
        for i in range(n):
            first = b["logit_start"][i]
            props = b["cu_q_lens"][i + 1] - b["n_draft"][i]  # a verify row ends in its proposals
            for j in range(b["n_draft"][i]):  # the device's rule: keep while sample == proposal
                if self.rng.random() < 0.5:
                    tokens[first + j] = fed[props + j]
                if tokens[first + j] != fed[props + j]:
                    break
                accepted[i] += 1
            if b["sample_mask"][i]:
                self.last[b["slots"][i]] = tokens[first + accepted[i]]
                if self.head:
                    self.acc[b["slots"][i]] = accepted[i]
                    props = [self.rng.randrange(VOCAB) for _ in range(self.k)]
                    self.props[b["slots"][i]] = props
                if self.draft:  # decode j feeds the last token (j = 0) or proposal j - 1
                    slot = b["slots"][i]
                    at = int(pos[b["cu_q_lens"][i + 1] - 1 - b["n_draft"][i]]) + accepted[i] + 1
                    end = self.slots.prompt_len[slot] + self.slots.max_tokens[slot]
                    fed_j = [self.last[slot], *self.props[slot][: self.k - 1]]
                    for j, t in enumerate(fed_j):
                        blk = b["block_tables"][i, (at + j) // P]
                        assert blk != 0 or at + j >= end, "draft decode past the claimed blocks"
                        self.dkv[blk * P + (at + j) % P] = t
        return {"tokens": tokens, "logprob": np.zeros(R, np.float32), "accepted": accepted}

    def launch_forward(self, b, T, S):  # the whole step runs when its sampling launches
        return b, T, S

    def launch_sample(self, fwd, b):
        return self.launch(*fwd)

    def fetch(self, launched):
        return launched

    def propose(self, rows, tables, t_bucket, s_bucket, want, sampling_rows=None):
        """The draft program: feed the catch-up rows, then each speculating row's first
        want - 1 proposals after them (as the device loop writes them). The rows' sampling
        inputs come padded to the bucket, one per row."""
        assert sampling_rows is None or sampling_rows["steps"].shape == (s_bucket,)
        b = lower(rows, tables, self.block_size, t_bucket, s_bucket)
        n_tok = sum(len(r.tokens) for r in rows)
        self.kv[b["write_idx"][:n_tok]] = b["tokens"][:n_tok]
        out = np.array([[self.rng.randrange(VOCAB) for _ in range(3)] for _ in rows])
        for i, (r, k) in enumerate(zip(rows, want, strict=True)):
            for j in range(k - 1):
                pos = r.start + len(r.tokens) + j
                blk = tables[r.slot, pos // self.block_size]
                assert blk != 0, "draft proposal written outside the slot's blocks"
                self.kv[blk * self.block_size + pos % self.block_size] = out[i, j]
        return out.reshape(len(rows), 3)

    def cached(self, table, n, kv=None):
        """Token ids at positions 0..n-1 of a sequence with block table `table` (in the
        target's cache, or in `kv`)."""
        pos = np.arange(n)
        return (self.kv if kv is None else kv)[
            np.asarray(table, np.int64)[pos // self.block_size] * self.block_size
            + pos % self.block_size
        ]


def check_caches(sched, engine):
    sl = engine.slots
    for req in sched.running.values():
        seq = req.prompt + req.output_ids
        if sched.decoding(req):  # a step in flight may have sampled one more, not yet seen
            in_flight = int(sl.generated[req.slot]) - len(req.output_ids)
            assert in_flight in ((0, 1) if engine.overlap else (0,))
        kv_len = int(sl.kv_len([req.slot])[0])
        cached = engine.runner.cached(engine.pool.tables[req.slot], kv_len)
        assert cached.tolist() == seq[:kv_len], f"slot {req.slot} cache corrupted"
        if engine.runner.draft or engine.runner.lookup:
            dcached = engine.runner.cached(engine.pool.tables[req.slot], kv_len, engine.runner.dkv)
            assert dcached.tolist() == seq[:kv_len], f"slot {req.slot} draft cache corrupted"
        if engine.refeed and sched.decoding(req):
            state = engine.runner.state[req.slot]
            assert (
                len(state) == kv_len - engine.outputs.lag[req.slot] and state == seq[: len(state)]
            )
        if engine.runner.replay and sched.decoding(req):  # a prefix of it; the rest pending
            state = engine.runner.state[req.slot]
            assert len(state) <= kv_len and state == seq[: len(state)]


# hybrid: the host's prompt lookup stands for a refeeding family (DeepSeek V4), the device's
# proposers for a replaying one (a draft head's fake device keeps no recurrent state)
MODES = [
    (m, h)
    for m in ("off", "ngram", "head", "device-draft", "device-ngram")
    for h in (False, True)
    if m != "head" or not h
]


def record_owners(engine) -> list[tuple[int, str, int]]:
    """(owner index, "start" / "release", slot) of every call the engine makes to its slot
    owners (host/slot_owner.py), in order."""
    events = []
    for i, owner in enumerate(engine.owners):
        for name in ("start", "release"):
            call = getattr(owner, name)
            setattr(owner, name, lambda slot, *a, i=i, name=name, call=call: (
                events.append((i, name, slot)), call(slot, *a))[1])  # fmt: skip
    return events


def check_owner_events(owners, events, admitted):
    """Every admission starts its slot in each owner, in list order; every retirement releases
    it in each, in reverse order; each owner's starts and releases of a slot alternate."""
    n = len(owners)
    assert len(events) % n == 0
    groups = [events[i : i + n] for i in range(0, len(events), n)]
    for g in groups:
        kinds, slots = {e[1] for e in g}, {e[2] for e in g}
        assert len(kinds) == 1 and len(slots) == 1, g
        order = [e[0] for e in g]
        assert order == (list(range(n)) if "start" in kinds else list(range(n))[::-1]), g
    assert sum(g[0][1] == "start" for g in groups) == admitted
    for i in range(n):
        held = set()
        for _, kind, slot in (e for e in events if e[0] == i):
            if kind == "start":
                assert slot not in held
                held.add(slot)
            else:
                held.discard(slot)  # a retired slot; releasing a free one changes nothing
        assert not held  # every slot released in the end


@pytest.mark.parametrize(
    ("mode", "hybrid"), MODES, ids=[f"{m}-{'hybrid' if h else 'dense'}" for m, h in MODES]
)
@pytest.mark.parametrize("seed", range(6))
def test_random_acceptance_and_cancellation_keep_every_cache_exact(mode, seed, hybrid):
    rng = random.Random(seed)
    cfg = EngineConfig(
        max_concurrency=4,
        max_ctx=64,
        kv_block_size=4,
        prefill_chunk=8,
        prefill_token_budget=16,
        draft_tokens=3,
        spec_mode={"device-draft": "draft", "device-ngram": "ngram"}.get(mode, mode),
        prefix_cache=not hybrid,  # as build.prefix_cache_off: a hybrid's state is not cached
    )
    blocks = 40
    k = 0 if mode == "off" else 3
    runner = FakeRunner(blocks, 4, 4, k, rng, recurrent=hybrid, head=mode == "head",
                        draft=mode == "device-draft", lookup=mode == "device-ngram")  # fmt: skip
    engine = StepEngine(cfg, runner)
    runner.slots = engine.slots
    assert engine.refeed == (hybrid and mode in ("off", "ngram"))
    if mode == "off":  # overlapped steps: each is collected after the next is dispatched
        proposer = None
    elif mode in ("head", "device-draft", "device-ngram"):
        proposer = OnDeviceProposer()
    else:
        proposer = NgramProposer()
    if proposer is not None:
        flat = dict.fromkeys(engine.token_buckets, 1.0)  # every bucket free: always propose
        pol = SpecPolicy(3, flat, min_gain=0.0)
        pol.observe_step = lambda seconds: None  # keep it proposing whatever the host takes
        engine.enable_speculation(Speculator(proposer, pol, mode))
    sched = Scheduler(engine)
    owners, events = engine.owners, record_owners(engine)
    retire, early = engine.retire, []

    def retire_counting(slot):  # retired while a step that computes for it is still in flight
        early.append(engine.in_flight > 0)
        retire(slot)

    engine.retire = retire_counting
    reqs, cancelled = [], 0
    for step in range(400):
        if step < 250 and rng.random() < 0.3:
            sp = SamplingParams(
                max_tokens=rng.randint(1, 20),
                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.3 else [],
                ignore_eos=True,
            )
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            reqs.append(Request(prompt, sp))
            sched.add(reqs[-1])
        live = [r for r in sched.running.values()]
        if live and rng.random() < 0.1:
            sched.cancel(rng.choice(live))
            cancelled += 1
        sched.step()
        engine.pool.check()
        check_caches(sched, engine)
        if step > 250 and sched.idle:
            break
    assert sched.idle and cancelled > 0
    assert engine.pool.available == engine.pool.capacity
    assert engine.overlap == (mode in ("off", "head", "device-draft", "device-ngram"))
    if engine.overlap:
        assert sum(early) > 10  # the one-step lag was exercised, and its tokens dropped
    if mode != "off":
        assert engine.spec.accepted > 0 and max(engine.spec.accept_lengths) >= 2
    check_owner_events(owners, events, admitted=len(reqs))  # cancels pick running requests
    for r in reqs:  # tokens after the one that ends a request are never delivered
        assert r.done and r.finish_reason in ("stop", "length", "cancelled"), r.finish_reason
        assert len(r.output_ids) <= r.sampling.max_tokens
        stops = set(r.sampling.stop_token_ids)
        assert not stops & set(r.output_ids[:-1])
        if r.finish_reason == "stop":
            assert r.output_ids[-1] in stops
