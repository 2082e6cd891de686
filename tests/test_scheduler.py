"""Scheduler policy with a fake model: budget, chunking, admission, preemption order, copy-on-write,
and a hypothesis state machine (random arrivals, aborts, tiny pools) checking that no request is
lost and no block leaks.

The fake model's "next token" is a function of the sequence's tokens only, so a sequence's output
must not depend on how it was scheduled (chunked, preempted and recomputed, batched with others).
"""
import os

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedattn.block_manager import BlockManager
from pagedattn.engine.scheduler import Scheduler, SchedulerConfig
from pagedattn.engine.sequence import Sequence, SequenceStatus

VOCAB = 50


def fake_next_token(token_ids):
    return (sum(token_ids) * 31 + len(token_ids)) % VOCAB


class FakeEngine:
    """The engine's loop without a model: schedule, 'compute', append the fake next token."""

    total_steps = 0

    def __init__(self, num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, prefix_caching=False):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, block_size), self.bm)
        self.max_tokens = {}
        self.next_id = 0
        self.finished = {}
        self.outputs = []

    def add(self, prompt, max_tokens):
        seq = Sequence(self.next_id, self.next_id, prompt, len(prompt))
        self.next_id += 1
        self.max_tokens[seq.seq_id] = max_tokens
        self.sched.add(seq)
        return seq

    def step(self):
        FakeEngine.total_steps += 1
        running_before = {s.seq_id for s in self.sched.running}
        out = self.sched.schedule()
        self.outputs.append(out)
        self.check_step(out, running_before)
        self.sched.update(out)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(fake_next_token(seq.token_ids))
                if seq.num_output_tokens >= self.max_tokens[seq.seq_id]:
                    self.sched.finish(seq, "length")
                    self.finished[seq.seq_id] = seq
        self.bm.check()
        return out

    def check_step(self, out, running_before):
        cfg = self.sched.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        ns = [n for _, n in out.scheduled]
        assert all(n > 1 for n in ns[:out.num_prefills]) and all(n == 1 for n in ns[out.num_prefills:])
        if out.preempted:  # a step that preempted admits nobody new
            assert all(s.seq_id in running_before for s, _ in out.scheduled)
        for seq, n in out.scheduled:
            assert seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert len(self.bm.block_table(seq.seq_id)) * self.bm.block_size >= seq.num_computed_tokens + n

    def run(self, max_steps=10_000):
        steps = 0
        while self.sched.num_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


def expected_output(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_next_token(tokens))
    return tokens[len(prompt):]


def test_token_budget_and_chunked_prefill():
    eng = FakeEngine(num_blocks=64, max_num_batched_tokens=16)
    long = eng.add(list(range(1, 41)), max_tokens=3)       # 40 tokens: chunks of 16, 16, 8
    short = eng.add([7, 8, 9], max_tokens=3)
    out = eng.step()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(long.seq_id, 16)]
    out = eng.step()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(long.seq_id, 16)]
    out = eng.step()  # the long prompt's last 8 tokens and the short prompt's 3 share the step
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(long.seq_id, 8), (short.seq_id, 3)]
    out = eng.step()  # both decode now
    assert out.num_prefills == 0 and len(out.scheduled) == 2
    eng.run()
    assert long.output_token_ids == expected_output(range(1, 41), 3)
    assert short.output_token_ids == expected_output([7, 8, 9], 3)
    assert eng.bm.num_free_blocks == eng.bm.total_blocks


def test_prefills_packed_before_decodes():
    eng = FakeEngine(num_blocks=64)
    a = eng.add([1, 2, 3], max_tokens=5)
    eng.step()                                               # a prefilled, now decoding
    b = eng.add([4, 5, 6, 7], max_tokens=5)
    out = eng.step()
    assert [s.seq_id for s, _ in out.scheduled] == [b.seq_id, a.seq_id] and out.num_prefills == 1
    eng.run()


def test_max_num_seqs_caps_admission():
    eng = FakeEngine(num_blocks=64, max_num_seqs=2)
    seqs = [eng.add([i + 1, i + 2], max_tokens=4) for i in range(5)]
    out = eng.step()
    assert len(out.scheduled) == 2
    assert len(eng.sched.waiting) == 3
    eng.run()
    for i, s in enumerate(seqs):
        assert s.output_token_ids == expected_output([i + 1, i + 2], 4)


def test_admission_is_fifo_without_skipping():
    eng = FakeEngine(num_blocks=4, block_size=4)
    big = eng.add(list(range(1, 13)), max_tokens=2)          # 12 tokens: 3 blocks (of 4)
    eng.step()
    eng.add(list(range(1, 9)), max_tokens=2)                 # needs 2 blocks: only 1 free
    small = eng.add([3], max_tokens=1)                       # would fit, but must not jump the queue
    out = eng.step()
    assert [s.seq_id for s, _ in out.scheduled] == [big.seq_id]
    assert small.status == SequenceStatus.WAITING
    eng.run()


def test_preemption_takes_newest_and_admits_nobody_that_step():
    bs = 4
    eng = FakeEngine(num_blocks=4, block_size=bs, max_num_batched_tokens=64)
    old = eng.add([1, 2, 3], max_tokens=8)                   # 1 block, grows to 3
    new = eng.add([4, 5, 6], max_tokens=8)
    eng.step()
    eng.step()
    late = eng.add([9, 9], max_tokens=2)
    preempted = None
    for _ in range(20):
        out = eng.step()
        if out.preempted:
            preempted = out
            break
    assert preempted is not None
    assert preempted.preempted[0] is new                     # newest first
    assert all(s is not late for s, _ in preempted.scheduled)
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert eng.sched.waiting[0] is new                       # resumes before later arrivals
    eng.run()
    assert old.output_token_ids == expected_output([1, 2, 3], 8)
    assert new.output_token_ids == expected_output([4, 5, 6], 8)
    assert late.output_token_ids == expected_output([9, 9], 2)
    assert eng.sched.num_preemptions >= 1
    assert eng.bm.num_free_blocks == eng.bm.total_blocks


def test_fork_copies_shared_partial_block_on_first_write():
    eng = FakeEngine(num_blocks=16, block_size=4)
    parent = eng.add([1, 2, 3, 4, 5, 6], max_tokens=4)       # 2 blocks, the second partial
    eng.step()                                               # prefill; appends token 7
    child = parent.fork(99, 1)
    eng.bm.share_prefix(parent.seq_id, child.seq_id, len(eng.bm.block_table(parent.seq_id)))
    eng.sched.add_running(child)
    eng.max_tokens[99] = 4
    shared = eng.bm.block_table(parent.seq_id)[1]
    out = eng.step()
    # The parent writes first into the shared block and gets a copy; then the child owns the
    # original alone and writes in place.
    assert len(out.block_copies) == 1 and out.block_copies[0][0] == shared
    assert eng.bm.block_table(parent.seq_id)[1] != eng.bm.block_table(child.seq_id)[1]
    eng.run()
    assert eng.bm.num_free_blocks == eng.bm.total_blocks


def test_prefix_cache_hit_counts_as_computed():
    eng = FakeEngine(num_blocks=32, block_size=4, prefix_caching=True)
    prompt = list(range(1, 15))                              # 14 tokens: 3 full blocks + 2
    eng.add(prompt, max_tokens=2)
    eng.run()
    again = eng.add(prompt, max_tokens=2)
    out = eng.step()
    assert again.num_cached_tokens == 12
    assert [n for s, n in out.scheduled if s is again] == [2]
    eng.run()
    assert again.output_token_ids == expected_output(prompt, 2)


@pytest.mark.parametrize("num_blocks", [6, 10, 40])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_many_requests_tiny_pool_all_finish(num_blocks, prefix_caching):
    import random
    rng = random.Random(num_blocks)
    eng = FakeEngine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12, prefix_caching=prefix_caching)
    want = {}
    for _ in range(30):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))]
        if prefix_caching and rng.random() < 0.5:
            prompt = [5, 6, 7, 8, 9, 10, 11, 12] + prompt
        max_tokens = rng.randint(1, 24 - len(prompt) if len(prompt) < 20 else 1)
        if -(-(len(prompt) + max_tokens) // 4) > num_blocks:
            continue
        s = eng.add(prompt, max_tokens)
        want[s.seq_id] = expected_output(prompt, max_tokens)
    eng.run()
    assert {k: v.output_token_ids for k, v in eng.finished.items()} == want
    assert eng.bm.num_free_blocks == eng.bm.total_blocks


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, forks (copy-on-write), aborts and steps over a tiny pool (prefix caching on)."""

    def __init__(self):
        super().__init__()
        self.eng = FakeEngine(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=10, prefix_caching=True)
        self.live = {}      # seq_id -> (seq, expected output)
        self.aborted = set()

    @rule(prompt=st.lists(st.integers(1, 5), min_size=1, max_size=12), max_tokens=st.integers(1, 12))
    def arrive(self, prompt, max_tokens):
        if -(-(len(prompt) + max_tokens) // 4) > 8:
            return
        s = self.eng.add(prompt, max_tokens)
        self.live[s.seq_id] = (s, expected_output(prompt, max_tokens))

    def _forkable(self):
        # Running and caught up except for the token just sampled: how the engine forks n > 1 / beams.
        return sorted(s.seq_id for s in self.eng.sched.running if s.num_computed_tokens == s.num_tokens - 1)

    @precondition(lambda self: self._forkable())
    @rule(data=st.data())
    def fork(self, data):
        eng = self.eng
        parent_id = data.draw(st.sampled_from(self._forkable()))
        parent = next(s for s in eng.sched.running if s.seq_id == parent_id)
        child = parent.fork(eng.next_id, 1)
        eng.next_id += 1
        eng.bm.share_prefix(parent.seq_id, child.seq_id, len(eng.bm.block_table(parent.seq_id)))
        eng.sched.add_running(child)
        eng.max_tokens[child.seq_id] = eng.max_tokens[parent.seq_id]
        self.live[child.seq_id] = (child, self.live[parent.seq_id][1])

    @precondition(lambda self: any(not s.is_finished for s, _ in self.live.values()))
    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(k for k, (s, _) in self.live.items() if not s.is_finished)
        seq_id = data.draw(st.sampled_from(ids))
        self.eng.sched.finish(self.live[seq_id][0], "abort")
        self.aborted.add(seq_id)

    @rule()
    def step(self):
        if self.eng.sched.num_unfinished:
            self.eng.step()

    @invariant()
    def nothing_lost_nothing_leaked(self):
        sched, bm = self.eng.sched, self.eng.bm
        bm.check()
        in_queues = {s.seq_id for s in sched.waiting} | {s.seq_id for s in sched.running}
        unfinished = {k for k, (s, _) in self.live.items() if not s.is_finished}
        assert in_queues == unfinished
        held = {s.seq_id for s in sched.running}
        assert set(bm.sequence_blocks) == held
        for seq_id, (s, want) in self.live.items():
            if s.is_finished and seq_id not in self.aborted:
                assert s.output_token_ids == want
        if not unfinished:
            assert bm.num_free_blocks == bm.total_blocks

    def teardown(self):
        self.eng.run()
        assert self.eng.bm.num_free_blocks == self.eng.bm.total_blocks


# 60 runs x 50 rules = 3,000 random operations per CI run (over 1,000 of them scheduler steps, plus the
# steps that drain each run in teardown); PAGEDATTN_LONG_FUZZ=1 runs 25x more.
_SCALE = 25 if os.environ.get("PAGEDATTN_LONG_FUZZ") else 1
SchedulerMachine.TestCase.settings = settings(max_examples=60 * _SCALE, stateful_step_count=50, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
