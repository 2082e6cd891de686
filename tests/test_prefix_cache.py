"""Automatic prefix caching in the BlockManager: hits, misses, token comparison on a hash
collision, LRU eviction order, the last prompt token always recomputed, the hit-rate metric, and a
hypothesis state machine (allocate prompt, compute in chunks, decode, share, CoW, free, evict)
that checks the invariants and the *content* of every block after every step.

PAGEDATTN_HYPOTHESIS_PROFILE=long runs ~100x more random operations (see tests/test_block_manager.py).
"""
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import pagedattn.block_manager as block_manager
from pagedattn.block_manager import BlockManager
from pagedattn.errors import BlockManagerError, OutOfBlocksError

PROFILES = {"ci": (60, 50), "long": (2000, 200)}  # name -> (examples, max steps per example)
MIN_STEPS = {"ci": 1000, "long": 50_000}
PROFILE = os.environ.get("PAGEDATTN_HYPOTHESIS_PROFILE", "ci")
BS = 4


def cached_manager(total_blocks=8):
    return BlockManager(total_blocks, block_size=BS, enable_prefix_caching=True)


def prefill(bm, seq, tokens):
    """Allocate a prompt and commit it, as the engine does after the prefill step."""
    cached = bm.allocate_prompt(seq, tokens)
    bm.commit_full_blocks(seq, tokens)
    return cached


def test_miss_then_hit():
    bm = cached_manager()
    prompt = list(range(10))  # blocks [0..3] [4..7] [8, 9]
    assert prefill(bm, "a", prompt) == 0
    assert len(bm.block_hash) == 2  # two full blocks registered, the partial one not
    assert prefill(bm, "b", prompt) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    assert bm.ref_count[bm.block_table("a")[0]] == 2
    bm.check()


def test_hit_stops_at_first_differing_block():
    bm = cached_manager()
    prefill(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert prefill(bm, "b", [1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4   # second block differs
    assert prefill(bm, "c", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0   # first differs: no later hit either
    bm.check()


def test_same_block_after_a_different_prefix_misses():
    bm = cached_manager()
    prefill(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    assert prefill(bm, "b", [3, 3, 3, 3, 2, 2, 2, 2, 0]) == 0  # hash chains include the parent


def test_last_token_always_recomputed():
    bm = cached_manager()
    prompt = list(range(8))  # exactly two full blocks
    prefill(bm, "a", prompt)
    assert prefill(bm, "b", prompt) == 4  # the block holding the last token is fresh
    last_a, last_b = bm.block_table("a")[1], bm.block_table("b")[1]
    assert last_a != last_b and bm.ref_count[last_b] == 1 and last_b not in bm.block_hash
    assert prefill(bm, "c", prompt[:4]) == 0  # a one-block prompt never hits
    bm.check()


def test_free_cached_block_is_reused_and_leaves_free_list():
    bm = cached_manager(total_blocks=4)
    prefill(bm, "a", list(range(9)))  # blocks 0, 1 hashed, 2 partial
    bm.free_sequence("a")
    assert list(bm.free_blocks) == [3, 2, 1, 0] and len(bm.block_hash) == 2  # hashes kept
    assert bm.can_allocate_prompt(list(range(16)))  # 2 hits (free) + 2 fresh = 4 free blocks
    assert not bm.can_allocate_prompt(list(range(17)))
    assert prefill(bm, "b", list(range(16))) == 8
    assert bm.block_table("b")[:2] == [0, 1] and bm.num_free_blocks == 0
    bm.check()


def test_hits_in_use_cost_nothing():
    bm = cached_manager(total_blocks=4)
    prefill(bm, "a", list(range(9)))  # 3 blocks used, 1 free
    assert bm.can_allocate_prompt(list(range(9)))  # 2 shared + 1 fresh
    assert prefill(bm, "b", list(range(9))) == 8 and bm.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        bm.allocate_prompt("c", list(range(9)))
    bm.check()


def test_out_of_blocks_leaves_cached_free_blocks_alone():
    bm = cached_manager(total_blocks=3)
    prefill(bm, "a", list(range(8)))
    bm.free_sequence("a")
    before = (list(bm.free_blocks), dict(bm.block_hash), list(bm.ref_count))
    assert not bm.can_allocate_prompt(list(range(13)))  # 1 hit (free) + 3 fresh > 3 free
    with pytest.raises(OutOfBlocksError, match="13 tokens needs 4 blocks"):
        bm.allocate_prompt("b", list(range(13)))
    assert (list(bm.free_blocks), dict(bm.block_hash), list(bm.ref_count)) == before
    assert "b" not in bm.sequence_blocks
    bm.check()


def test_lru_eviction_order():
    bm = cached_manager(total_blocks=5)
    prefill(bm, "x", [1] * 5)   # block 0 hashed ([1]*4), block 1 partial
    prefill(bm, "y", [2] * 5)   # block 2 hashed ([2]*4), block 3 partial
    bm.free_sequence("y")       # free list: 4, 3, 2
    bm.free_sequence("x")       # free list: 4, 3, 2, 1, 0   (y's blocks freed before x's)
    assert list(bm.free_blocks) == [4, 3, 2, 1, 0]
    bm.ensure_capacity("filler", 12)  # takes 4, 3 (unhashed) then 2: evicts y's cached block
    assert bm.block_table("filler") == [4, 3, 2] and bm.num_evictions == 1
    assert 2 not in bm.block_hash and 0 in bm.block_hash
    bm.free_sequence("filler")
    assert prefill(bm, "x2", [1] * 5) == 4    # x's block was freed later: still cached
    assert prefill(bm, "y2", [2] * 5) == 0    # evicted: a miss
    bm.check()


def test_hash_collision_is_caught_by_token_comparison(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_block_tokens", lambda parent, tokens: 42)
    bm = cached_manager()
    prefill(bm, "a", [1, 2, 3, 4, 5])
    assert len(bm.block_hash) == 1
    assert prefill(bm, "b", [9, 9, 9, 9, 5]) == 0  # same hash, other tokens: a miss
    assert bm.block_table("b")[0] != bm.block_table("a")[0]
    assert len(bm.block_hash) == 1  # the colliding block is not registered over the first
    assert prefill(bm, "c", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4  # first block: real hit
    # c's second block hashes to 42 too, but its key (parent 42, tokens) differs: a miss
    assert prefill(bm, "d", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    bm.check()


def test_hit_rate_metric():
    bm = cached_manager()
    assert bm.prefix_cache_hit_rate == 0.0
    prefill(bm, "a", list(range(10)))
    prefill(bm, "b", list(range(10)))
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (20, 8)
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 20)


def test_caching_off():
    bm = BlockManager(8, block_size=BS)
    assert prefill(bm, "a", list(range(10))) == 0
    assert prefill(bm, "b", list(range(10))) == 0
    assert not bm.block_hash and bm.num_query_tokens == 0 and bm.block_table("b") == [3, 4, 5]
    bm.check()


def test_commit_is_idempotent_and_incremental():
    bm = cached_manager()
    bm.allocate_prompt("a", list(range(12)))
    bm.commit_full_blocks("a", list(range(6)))  # chunked prefill: one block full so far
    assert list(bm.block_hash) == [bm.block_table("a")[0]]
    bm.commit_full_blocks("a", list(range(6)))
    bm.commit_full_blocks("a", list(range(12)))
    bm.commit_full_blocks("a", list(range(12)))
    assert sorted(bm.block_hash) == sorted(bm.block_table("a")) and len(bm.seq_hashes["a"]) == 3
    bm.check()


def test_commit_errors():
    bm = cached_manager()
    bm.allocate_prompt("a", list(range(6)))
    with pytest.raises(BlockManagerError, match="exceed"):
        bm.commit_full_blocks("a", list(range(9)))
    with pytest.raises(BlockManagerError, match="unknown"):
        bm.commit_full_blocks("zz", [1])
    bm.commit_full_blocks("a", list(range(4)))
    bm.share_prefix("a", "b", 2)
    bm.seq_hashes["b"].clear()  # forget what b knows: a recommit with other tokens is caught
    with pytest.raises(BlockManagerError, match="cached with other tokens"):
        bm.commit_full_blocks("b", [7, 7, 7, 7])


def test_allocate_prompt_errors():
    bm = cached_manager()
    bm.allocate_blocks("a", 1)
    with pytest.raises(BlockManagerError, match="already holds blocks"):
        bm.allocate_prompt("a", [1, 2])
    with pytest.raises(BlockManagerError, match="empty"):
        bm.allocate_prompt("b", [])


def test_shared_prefix_keeps_hash_and_cow_copy_is_unhashed():
    bm = cached_manager()
    prefill(bm, "p", list(range(6)))              # block 0 hashed, block 1 partial
    bm.share_prefix("p", "c", 2)                 # parallel sampling fork
    bm.commit_full_blocks("c", list(range(6)))
    h0 = bm.block_table("p")[0]
    assert bm.block_hash[h0] == bm.seq_hashes["c"][0] and len(bm.block_hash) == 1
    old, new = bm.cow_block("c", 1)              # child writes token 6 into the shared partial block
    assert old != new and new not in bm.block_hash
    old, new = bm.cow_block("c", 0)              # a shared *hashed* block: the copy is unhashed,
    assert old == h0 and new not in bm.block_hash and bm.block_hash[h0] == bm.seq_hashes["p"][0]
    assert bm.seq_hashes["c"] == []              # ... and c recommits from block 0
    bm.commit_full_blocks("c", list(range(8)))   # the copy's hash is already held by h0: unregistered
    assert new not in bm.block_hash and len(bm.seq_hashes["c"]) == 2
    bm.check()


def test_cow_of_exclusive_hashed_block_unregisters_it():
    bm = cached_manager()
    prefill(bm, "a", list(range(5)))
    b0 = bm.block_table("a")[0]
    assert bm.cow_block("a", 0) == (b0, b0)
    assert b0 not in bm.block_hash and not bm.cached_blocks  # about to be written: not a cache entry
    assert prefill(bm, "b", list(range(5))) == 0
    bm.check()


# ---- random operations with the prefix cache ---------------------------------------------------

class PrefixCacheMachine(RuleBasedStateMachine):
    """The engine's calls in random order, on a tiny pool with a 3-token vocabulary so that hits,
    collisions of content, forks and evictions are frequent. A simulated pool records the token
    written at every slot; after every step each sequence must read back its computed tokens
    through its block table, and every hashed block must hold exactly its key's tokens."""
    steps = 0
    TOTAL = 10

    @initialize()
    def setup(self):
        self.bm = BlockManager(self.TOTAL, block_size=BS, enable_prefix_caching=True)
        self.tokens = {}    # seq -> every known token (prompt + generated)
        self.computed = {}  # seq -> how many of them have KV in the pool
        self.pool = {}      # (block, offset) -> token
        self.history = []   # every prompt seen, live or freed
        self.next_seq = self.queries = self.hits = 0

    def _compute(self, seq, n):
        """Write the KV of the next n known tokens (chunked prefill or decode), then commit."""
        for pos in range(self.computed[seq], self.computed[seq] + n):
            i = pos // BS
            old, new = self.bm.cow_block(seq, i) if self.bm.is_shared(seq, i) else (None, None)
            if old is not None:
                for off in range(BS):
                    if (old, off) in self.pool:
                        self.pool[(new, off)] = self.pool[(old, off)]
            block = self.bm.block_table(seq)[i]
            assert self.bm.ref_count[block] == 1 and block not in self.bm.block_hash, \
                "a write would land in a shared or cached block"
            self.pool[(block, pos % BS)] = self.tokens[seq][pos]
            self.computed[seq] += 1
        self.bm.commit_full_blocks(seq, self.tokens[seq][:self.computed[seq]])

    @rule(data=st.data(), fresh=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def allocate_prompt(self, data, fresh):
        prompt = fresh
        if self.history and data.draw(st.booleans()):  # an earlier prompt's head (+ a tail): hits
            old = data.draw(st.sampled_from(self.history))
            prompt = old[:data.draw(st.integers(1, len(old)))] + fresh[:data.draw(st.integers(0, 3))]
        self.history.append(prompt)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        fits = self.bm.can_allocate_prompt(prompt)
        try:
            cached = self.bm.allocate_prompt(seq, prompt)
        except OutOfBlocksError:
            assert not fits
            return
        assert fits and cached % BS == 0 and 0 <= cached < len(prompt)
        self.queries, self.hits = self.queries + len(prompt), self.hits + cached
        self.tokens[seq], self.computed[seq] = prompt, cached
        table = self.bm.block_table(seq)
        assert len(table) == -(-len(prompt) // BS)
        for pos in range(cached):  # every served token really is in the pool
            assert self.pool[(table[pos // BS], pos % BS)] == prompt[pos]
        if data.draw(st.booleans()):  # prefill in one step (else compute_chunk does it in chunks)
            self._compute(seq, len(prompt) - cached)

    @precondition(lambda self: any(self.computed[s] < len(self.tokens[s]) for s in self.tokens))
    @rule(data=st.data())
    def compute_chunk(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s in self.tokens if self.computed[s] < len(self.tokens[s]))))
        n = data.draw(st.integers(1, len(self.tokens[seq]) - self.computed[seq]))
        try:
            self._compute(seq, n)
        except OutOfBlocksError:  # a CoW with an empty pool; the tokens written before it stay
            assert self.bm.num_free_blocks == 0

    @precondition(lambda self: any(self.computed[s] == len(self.tokens[s]) for s in self.tokens))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(sorted(s for s in self.tokens if self.computed[s] == len(self.tokens[s]))))
        n = len(self.tokens[seq]) + 1
        if not self.bm.can_allocate(self.bm.blocks_needed(seq, n)):
            with pytest.raises(OutOfBlocksError):
                self.bm.ensure_capacity(seq, n)
            return
        self.bm.ensure_capacity(seq, n)
        self.tokens[seq].append(token)
        try:
            self._compute(seq, 1)
        except OutOfBlocksError:  # the block to write is shared and the pool is empty
            assert self.bm.num_free_blocks == 0
            self.tokens[seq].pop()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        n_blocks = data.draw(st.integers(0, len(self.bm.block_table(src))))
        tgt, self.next_seq = self.next_seq, self.next_seq + 1
        self.bm.share_prefix(src, tgt, n_blocks)
        self.computed[tgt] = min(self.computed[src], n_blocks * BS)
        self.tokens[tgt] = self.tokens[src][:self.computed[tgt]]
        self.bm.commit_full_blocks(tgt, self.tokens[tgt])

    @precondition(lambda self: any(self.bm.sequence_blocks.get(s) for s in self.tokens))
    @rule(data=st.data())
    def explicit_cow(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s in self.tokens if self.bm.sequence_blocks[s])))
        i = data.draw(st.integers(0, len(self.bm.block_table(seq)) - 1))
        try:
            old, new = self.bm.cow_block(seq, i)
        except OutOfBlocksError:
            assert self.bm.num_free_blocks == 0
            return
        assert new not in self.bm.block_hash
        for off in range(BS):
            if old != new and (old, off) in self.pool:
                self.pool[(new, off)] = self.pool[(old, off)]
        self.bm.commit_full_blocks(seq, self.tokens[seq][:self.computed[seq]])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free_sequence(seq)
        del self.tokens[seq], self.computed[seq]

    @rule(n=st.integers(1, 6))
    def memory_pressure(self, n):
        """A request that takes blocks off the free list, evicting cached ones, then leaves."""
        if self.bm.can_allocate(n):
            self.bm.allocate_blocks("filler", n)
            self.bm.check()
            self.bm.free_sequence("filler")

    @invariant()
    def consistent(self):
        PrefixCacheMachine.steps += 1
        bm = self.bm
        bm.check()
        assert (bm.num_query_tokens, bm.num_hit_tokens) == (self.queries, self.hits)
        for seq, toks in self.tokens.items():
            table = bm.block_table(seq)
            for pos in range(self.computed[seq]):
                assert self.pool[(table[pos // BS], pos % BS)] == toks[pos], (seq, pos)
        for block, (_, key_tokens) in bm.block_key.items():  # a cache entry holds what it claims
            assert tuple(self.pool.get((block, off)) for off in range(BS)) == key_tokens

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free_sequence(seq)
        self.bm.check()
        assert self.bm.num_free_blocks == self.TOTAL and not self.bm.sequence_blocks


def test_random_operations_with_prefix_cache():
    examples, steps = PROFILES[PROFILE]
    PrefixCacheMachine.steps = 0
    run_state_machine_as_test(PrefixCacheMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert PrefixCacheMachine.steps >= MIN_STEPS[PROFILE], PrefixCacheMachine.steps
