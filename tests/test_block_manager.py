"""BlockManager: each operation and each error, a share -> CoW -> free walk-through checked at
every step, a hypothesis state machine against a shadow model, and the memory-efficiency script.

The state machine runs >= 1,000 random operations per run (a few seconds). By hand, ~100x more
(>= 50,000 operations per machine, ~10 minutes for both files on 2 cores):
    PAGEDATTN_HYPOTHESIS_PROFILE=long python -m pytest tests/test_block_manager.py tests/test_prefix_cache.py
"""
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pagedattn.block_manager import BlockManager
from pagedattn.errors import BlockManagerError, OutOfBlocksError, PagedAttnError

PROFILES = {  # name -> (examples, max steps per example)
    "ci": (40, 50),
    "long": (2000, 200),
}
MIN_STEPS = {"ci": 1000, "long": 50_000}
PROFILE = os.environ.get("PAGEDATTN_HYPOTHESIS_PROFILE", "ci")
TOKEN_COUNTS = [0, 1, 15, 16, 17, 97]


def state(bm):
    """Everything observable, to compare before/after a failed call."""
    return (list(bm.free_blocks), list(bm.ref_count), {s: list(t) for s, t in bm.sequence_blocks.items()},
            dict(bm.block_hash), {s: list(h) for s, h in bm.seq_hashes.items()})


# ---- construction ------------------------------------------------------------------------------

def test_new_manager_is_all_free():
    bm = BlockManager(total_blocks=10)
    bm.check()
    assert (bm.block_size, bm.num_free_blocks, bm.num_used_blocks, bm.utilization) == (16, 10, 0, 0.0)
    assert list(bm.free_blocks) == list(range(10))


@pytest.mark.parametrize("kwargs", [dict(total_blocks=-1), dict(total_blocks=4, block_size=0),
                                    dict(total_blocks=2.5)])
def test_bad_config_is_a_value_error(kwargs):
    with pytest.raises(BlockManagerError):
        BlockManager(**kwargs)
    assert issubclass(BlockManagerError, ValueError) and issubclass(BlockManagerError, PagedAttnError)


# ---- allocate_blocks / free_sequence -----------------------------------------------------------

def test_allocate_appends_and_creates():
    bm = BlockManager(8)
    assert bm.allocate_blocks("a", 3) == [0, 1, 2]
    assert bm.allocate_blocks("a", 2) == [3, 4]
    assert bm.allocate_blocks("b", 0) == [] and bm.block_table("b") == []
    assert bm.block_table("a") == [0, 1, 2, 3, 4]
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.utilization) == (5, 3, 5 / 8)
    assert bm.ref_count == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.check()


def test_allocate_out_of_blocks_changes_nothing():
    bm = BlockManager(4)
    bm.allocate_blocks("a", 3)
    before = state(bm)
    assert not bm.can_allocate(2) and bm.can_allocate(1)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks"):
        bm.allocate_blocks("a", 2)
    with pytest.raises(OutOfBlocksError):
        bm.allocate_blocks("new", 2)
    assert state(bm) == before and "new" not in bm.sequence_blocks
    bm.check()


@pytest.mark.parametrize("n", [-1, 1.0, None])
def test_allocate_bad_n(n):
    with pytest.raises(BlockManagerError, match="n must be"):
        BlockManager(4).allocate_blocks("a", n)


def test_free_returns_blocks_in_reverse_table_order():
    bm = BlockManager(6)
    bm.allocate_blocks("a", 3)
    bm.allocate_blocks("b", 1)
    bm.free_sequence("a")
    assert list(bm.free_blocks) == [4, 5, 2, 1, 0]  # never-used first, then a's tail before its head
    assert "a" not in bm.sequence_blocks and bm.ref_count == [0, 0, 0, 1, 0, 0]
    bm.check()
    with pytest.raises(BlockManagerError, match="unknown sequence 'a'"):
        bm.free_sequence("a")


# ---- ensure_capacity / predicates --------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_ensure_capacity_allocates_only_what_is_missing(num_tokens):
    bm = BlockManager(16, block_size=16)
    expected = -(-num_tokens // 16)
    assert bm.blocks_needed("s", num_tokens) == expected
    assert len(bm.ensure_capacity("s", num_tokens)) == expected
    assert len(bm.block_table("s")) == expected
    assert bm.ensure_capacity("s", num_tokens) == [] and bm.blocks_needed("s", num_tokens) == 0
    assert bm.ensure_capacity("s", max(num_tokens - 5, 0)) == []  # never shrinks
    assert len(bm.ensure_capacity("s", num_tokens + 1)) == (1 if num_tokens % 16 == 0 else 0)
    bm.check()


def test_ensure_capacity_errors():
    bm = BlockManager(2, block_size=4)
    with pytest.raises(BlockManagerError, match="num_tokens"):
        bm.ensure_capacity("s", -1)
    bm.ensure_capacity("s", 5)
    with pytest.raises(OutOfBlocksError):
        bm.ensure_capacity("s", 9)
    assert bm.block_table("s") == [0, 1]
    bm.check()


def test_block_table_is_a_copy_and_unknown_is_an_error():
    bm = BlockManager(4)
    bm.allocate_blocks("a", 2)
    bm.block_table("a").append(99)
    assert bm.block_table("a") == [0, 1]
    with pytest.raises(BlockManagerError, match="unknown sequence"):
        bm.block_table("zz")


def test_internal_fragmentation():
    bm = BlockManager(10, block_size=16)
    bm.ensure_capacity("a", 17)  # 2 blocks, 15 slots empty
    bm.ensure_capacity("b", 32)  # 2 blocks, full
    frag = bm.internal_fragmentation({"a": 17, "b": 32})
    assert (frag.wasted_slots, frag.allocated_slots) == (15, 64)
    assert frag.ratio == pytest.approx(15 / 64)
    assert BlockManager(1).internal_fragmentation({}).ratio == 0.0
    with pytest.raises(BlockManagerError, match=r"seq_lens\['a'\] must be in \[0, 32\]"):
        bm.internal_fragmentation({"a": 33})
    with pytest.raises(BlockManagerError, match="unknown"):
        bm.internal_fragmentation({"zz": 0})


# ---- share_prefix / cow_block ------------------------------------------------------------------

def test_share_then_cow_then_free_step_by_step():
    bm = BlockManager(6, block_size=4)
    bm.ensure_capacity("parent", 10)  # blocks 0, 1 full; block 2 holds 2 tokens
    assert bm.block_table("parent") == [0, 1, 2]
    assert list(bm.free_blocks) == [3, 4, 5]

    bm.share_prefix("parent", "child", 3)  # fork: the partial last block is shared too
    bm.check()
    assert bm.block_table("child") == [0, 1, 2]
    assert bm.ref_count == [2, 2, 2, 0, 0, 0] and list(bm.free_blocks) == [3, 4, 5]
    assert bm.is_shared("child", 2)

    # child writes token 10 into block 2: shared, so it gets a copy
    assert bm.cow_block("child", 2) == (2, 3)
    bm.check()
    assert bm.block_table("child") == [0, 1, 3] and bm.block_table("parent") == [0, 1, 2]
    assert bm.ref_count == [2, 2, 1, 1, 0, 0] and list(bm.free_blocks) == [4, 5]

    # parent now owns block 2 alone: writing needs no copy
    assert bm.cow_block("parent", 2) == (2, 2)
    bm.check()
    assert bm.ref_count == [2, 2, 1, 1, 0, 0] and list(bm.free_blocks) == [4, 5]

    bm.free_sequence("parent")
    bm.check()
    assert bm.ref_count == [1, 1, 0, 1, 0, 0] and list(bm.free_blocks) == [4, 5, 2]
    assert bm.cow_block("child", 0) == (0, 0)  # last holder of the shared prefix

    bm.free_sequence("child")
    bm.check()
    assert bm.ref_count == [0] * 6 and list(bm.free_blocks) == [4, 5, 2, 3, 1, 0]


def test_share_prefix_partial_and_zero():
    bm = BlockManager(8, block_size=4)
    bm.ensure_capacity("s", 12)
    bm.share_prefix("s", "t", 2)
    bm.share_prefix("s", "u", 0)
    assert bm.block_table("t") == [0, 1] and bm.block_table("u") == []
    assert bm.ref_count[:3] == [2, 2, 1]
    bm.ensure_capacity("t", 9)  # t grows on its own block
    assert bm.block_table("t") == [0, 1, 3]
    bm.check()


def test_share_prefix_errors_change_nothing():
    bm = BlockManager(8, block_size=4)
    bm.allocate_blocks("s", 2)
    bm.allocate_blocks("busy", 1)
    bm.allocate_blocks("empty", 0)
    before = state(bm)
    with pytest.raises(BlockManagerError, match="unknown sequence 'nope'"):
        bm.share_prefix("nope", "t", 1)
    with pytest.raises(BlockManagerError, match=r"n_blocks must be in \[0, 2\]"):
        bm.share_prefix("s", "t", 3)
    with pytest.raises(BlockManagerError, match="n_blocks"):
        bm.share_prefix("s", "t", -1)
    with pytest.raises(BlockManagerError, match="must be a new sequence"):
        bm.share_prefix("s", "busy", 1)
    with pytest.raises(BlockManagerError, match="must be a new sequence"):
        bm.share_prefix("s", "s", 0)
    assert state(bm) == before
    bm.share_prefix("s", "empty", 2)  # a target with an empty table holds no blocks: allowed
    assert bm.block_table("empty") == [0, 1]
    bm.check()


def test_cow_out_of_blocks_changes_nothing():
    bm = BlockManager(2, block_size=4)
    bm.allocate_blocks("a", 2)
    bm.share_prefix("a", "b", 2)
    before = state(bm)
    with pytest.raises(OutOfBlocksError, match="copy-on-write"):
        bm.cow_block("b", 1)
    assert state(bm) == before
    bm.check()


@pytest.mark.parametrize("index", [-1, 2, 1.0])
def test_cow_bad_index(index):
    bm = BlockManager(4)
    bm.allocate_blocks("a", 2)
    with pytest.raises(BlockManagerError, match="block_index"):
        bm.cow_block("a", index)
    with pytest.raises(BlockManagerError, match="unknown"):
        bm.cow_block("zz", 0)


def test_check_catches_corruption():
    bm = BlockManager(4)
    bm.allocate_blocks("a", 2)
    bm.ref_count[0] = 2
    with pytest.raises(AssertionError, match="ref_count 2 != 1 holders"):
        bm.check()
    bm.ref_count[0] = 1
    bm.sequence_blocks["a"].append(7)
    with pytest.raises(AssertionError, match="out of range"):
        bm.check()
    bm.sequence_blocks["a"].pop()
    bm.free_blocks[0] = None
    with pytest.raises(AssertionError, match="free=True"):
        bm.check()


# ---- random operations against a shadow model -------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / share / CoW / free, with a simulated KV pool.

    Shadow model: each sequence is a list of *logical* block labels (a fresh label per allocated
    block; share copies labels; CoW of a label held more than once gives a fresh label). Its
    predictions: used blocks == distinct labels, a CoW copies iff the label is shared, and real
    ids <-> labels is a bijection. Each sequence also writes its tokens into a simulated pool
    through its block table (CoW first when the block is shared) and must read them back."""
    steps = 0
    TOTAL, BS = 12, 4

    @initialize()
    def setup(self):
        self.bm = BlockManager(self.TOTAL, block_size=self.BS)
        self.labels = {}   # seq -> list of labels
        self.tokens = {}   # seq -> tokens written (the sequence's content)
        self.pool = {}     # (block id, offset) -> token
        self.next_label = self.next_seq = 0

    def _new_label(self):
        self.next_label += 1
        return self.next_label

    def _shadow_used(self):
        return len({lab for labs in self.labels.values() for lab in labs})

    def _write(self, seq, new_tokens):
        """What the runtime does: grow, CoW the block about to be written, write the slot."""
        for tok in new_tokens:
            pos = len(self.tokens[seq])
            self.bm.ensure_capacity(seq, pos + 1)
            while len(self.labels[seq]) < len(self.bm.block_table(seq)):
                self.labels[seq].append(self._new_label())
            i = pos // self.BS
            shared = sum(labs.count(self.labels[seq][i]) for labs in self.labels.values()) > 1
            old, new = self.bm.cow_block(seq, i)
            assert (old != new) == shared
            if old != new:
                self.labels[seq][i] = self._new_label()
                for off in range(self.BS):
                    if (old, off) in self.pool:
                        self.pool[(new, off)] = self.pool[(old, off)]
            self.pool[(self.bm.block_table(seq)[i], pos % self.BS)] = tok
            self.tokens[seq].append(tok)

    def _free_after(self, extra_blocks):
        return self.TOTAL - self._shadow_used() - extra_blocks

    @rule(n=st.integers(0, 5))
    def allocate_new(self, n):
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if self._free_after(n) < 0:
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate_blocks(seq, n)
            return
        assert len(self.bm.allocate_blocks(seq, n)) == n
        self.labels[seq] = [self._new_label() for _ in range(n)]
        self.tokens[seq] = []

    @precondition(lambda self: self.labels)
    @rule(data=st.data(), n_tokens=st.integers(1, 9))
    def grow(self, data, n_tokens):
        seq = data.draw(st.sampled_from(sorted(self.labels)))
        try:
            self._write(seq, [data.draw(st.integers(0, 99)) for _ in range(n_tokens)])
        except OutOfBlocksError:
            assert self._free_after(1) < 0  # only when the pool is really empty
            # the tokens written before the failure stay; the table matches the labels
            while len(self.labels[seq]) < len(self.bm.block_table(seq)):
                self.labels[seq].append(self._new_label())

    @precondition(lambda self: self.labels)
    @rule(data=st.data())
    def share(self, data):
        src = data.draw(st.sampled_from(sorted(self.labels)))
        n = data.draw(st.integers(0, len(self.labels[src])))
        tgt, self.next_seq = self.next_seq, self.next_seq + 1
        self.bm.share_prefix(src, tgt, n)
        self.labels[tgt] = self.labels[src][:n]
        self.tokens[tgt] = self.tokens[src][:n * self.BS]

    @precondition(lambda self: any(self.labels.values()))
    @rule(data=st.data())
    def cow(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s, labs in self.labels.items() if labs)))
        i = data.draw(st.integers(0, len(self.labels[seq]) - 1))
        shared = sum(labs.count(self.labels[seq][i]) for labs in self.labels.values()) > 1
        if shared and self._free_after(1) < 0:
            with pytest.raises(OutOfBlocksError):
                self.bm.cow_block(seq, i)
            return
        old, new = self.bm.cow_block(seq, i)
        assert (old != new) == shared
        if shared:
            self.labels[seq][i] = self._new_label()
            for off in range(self.BS):
                if (old, off) in self.pool:
                    self.pool[(new, off)] = self.pool[(old, off)]

    @precondition(lambda self: self.labels)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.labels)))
        self.bm.free_sequence(seq)
        del self.labels[seq], self.tokens[seq]

    @invariant()
    def consistent(self):
        BlockManagerMachine.steps += 1
        self.bm.check()
        assert self.bm.num_used_blocks == self._shadow_used()
        label_of = {}
        for seq, labs in self.labels.items():
            table = self.bm.block_table(seq)
            assert len(table) == len(labs)
            for block, lab in zip(table, labs):
                assert label_of.setdefault(block, lab) == lab  # one label per block
            for pos, tok in enumerate(self.tokens[seq]):
                assert self.pool[(table[pos // self.BS], pos % self.BS)] == tok
        assert len(set(label_of.values())) == len(label_of)  # ... and one block per label

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.labels):
            self.bm.free_sequence(seq)
        self.bm.check()
        assert self.bm.num_free_blocks == self.TOTAL and not self.bm.sequence_blocks  # nothing leaks


def test_random_operations_against_shadow_model():
    examples, steps = PROFILES[PROFILE]
    BlockManagerMachine.steps = 0
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert BlockManagerMachine.steps >= MIN_STEPS[PROFILE], BlockManagerMachine.steps


# ---- scripts/memory_efficiency.py --------------------------------------------------------------

def load_memory_script():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "memory_efficiency.py")
    spec = importlib.util.spec_from_file_location("memory_efficiency", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_script_matches_hand_calculation(capsys):
    me = load_memory_script()
    # 3 sequences of 17 tokens, max_model_len 64, Qwen2-0.5B: 24 * 2 * 2 * 64 * 2 = 12288 B/token.
    r = me.main(num_seqs=3, min_len=17, max_len=17, max_model_len=64, budget_mib=1.5, block_size=16)
    mix = r["mix"]
    assert r["lengths"] == [17, 17, 17]
    assert mix["bytes_used"] == 3 * 17 * 12288
    assert mix["contiguous_reserved"] == 3 * 64 * 12288
    assert mix["paged_reserved"] == 3 * 2 * 16 * 12288              # 2 blocks of 16 slots each
    assert mix["contiguous_waste_pct"] == pytest.approx(100 * 47 / 64)
    assert mix["paged_waste_pct"] == pytest.approx(100 * 15 / 32)
    assert mix["reduction_pct"] == pytest.approx(50.0)
    # 1.5 MiB = 1572864 B: contiguous 786432 B/seq -> 2; paged 196608 B/block -> 8 blocks -> 4 seqs
    assert (mix["contiguous_fit"], mix["paged_fit"]) == (2, 4)
    assert "| paged (block_size 16) |" in capsys.readouterr().out


def test_memory_script_reproduces_design_table():
    me = load_memory_script()
    for seqs, cont, paged, cont_per, paged_per, reduction in me.design_table():
        assert (cont_per, paged_per) == (0.75, 0.25) and cont == 0.75 * seqs and paged == 0.25 * seqs
        assert reduction == pytest.approx(200 / 3)
