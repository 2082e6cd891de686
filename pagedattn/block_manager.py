"""The BlockManager: which physical KV blocks each sequence owns.

Plain state, in vLLM's words:

    free_blocks      free list: block ids with ref_count 0, ordered by the time they were freed
                     (oldest first; allocation takes from the front)
    ref_count        [total_blocks] how many block-table entries point at each block
    sequence_blocks  seq_id -> block table (array('i') of physical block ids, logical order: a step
                     packs every table with one bytes join)

A sequence's token at position p lives in block `sequence_blocks[seq][p // block_size]` at offset
`p % block_size`. Sharing (share_prefix) only bumps ref counts; a writer into a shared block first
calls cow_block and copies the data when it gets back two different ids.

Automatic prefix caching (enable_prefix_caching=True) adds a hash chain over *full* blocks:

    hash_i = hash_block_tokens(hash_{i-1}, tokens of block i)        (hash_{-1} = None)

A full, computed block is registered under its hash (commit_full_blocks). A later prompt with the
same leading tokens reuses it (allocate_prompt), after confirming the hit by comparing the stored
(parent hash, token ids) key, so a collision of a block's hash never serves wrong KV (the
SHA-256 chain makes a collision of the parent hashes, which that check cannot see, infeasible).
A freed block keeps its hash while it waits in the free list, which is therefore an LRU of
evictable cached blocks; the hash is dropped only when the block is taken for new data.
"""
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedattn.errors import BlockManagerError, OutOfBlocksError


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int] | bytes) -> int:
    """Chain hash of one full block: depends on the block's tokens and on every block before it.
    token_ids: the block's ids, or their bytes as little-endian int64 (what callers hashing many blocks
    pass: one conversion for all of them).

    SHA-256 rather than Python's hash(): prompts come from users, and a crafted collision of the
    parent hashes could otherwise make two different prefixes share KV."""
    h = hashlib.sha256(b"root" if parent_hash is None else parent_hash.to_bytes(32, "little"))
    h.update(token_ids if isinstance(token_ids, bytes) else array("q", token_ids).tobytes())  # int64 ids
    return int.from_bytes(h.digest(), "little")


class Fragmentation(NamedTuple):
    wasted_slots: int     # token slots allocated but holding no token
    allocated_slots: int  # len(block table) * block_size, summed over the sequences asked about
    ratio: float          # wasted_slots / allocated_slots (0.0 when nothing is allocated)


def _state(**kwargs):
    return field(init=False, repr=False, **kwargs)


@dataclass
class BlockManager:
    total_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = False

    # State, filled by __post_init__ (left out of repr: it can be large).
    free_blocks: OrderedDict = _state()                 # block id -> None, oldest-freed first
    ref_count: list[int] = _state()                     # [total_blocks]
    sequence_blocks: dict[Hashable, array] = _state()     # seq_id -> array('i') of block ids
    # Prefix cache. A hashed block keeps its hash while used *and* while free (evictable).
    block_hash: dict[int, int] = _state()               # block id -> chain hash
    block_key: dict[int, tuple] = _state()              # block id -> (parent hash, token ids)
    cached_blocks: dict[int, int] = _state()            # chain hash -> block id, 1:1 with block_hash
    seq_hashes: dict[Hashable, list[int]] = _state()    # seq -> chain hashes of its committed blocks
    num_query_tokens: int = _state(default=0)           # prompt tokens looked up
    num_hit_tokens: int = _state(default=0)             # of those, served from the cache
    num_evictions: int = _state(default=0)              # cached blocks taken for new data
    min_free_blocks: int = _state(default=0)            # the free list's low-water mark (peak usage)

    def __post_init__(self):
        if not isinstance(self.total_blocks, int) or self.total_blocks < 0:
            raise BlockManagerError(f"total_blocks must be an int >= 0, got {self.total_blocks!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise BlockManagerError(f"block_size must be an int >= 1, got {self.block_size!r}")
        self.free_blocks = OrderedDict.fromkeys(range(self.total_blocks))
        self.min_free_blocks = self.total_blocks
        self.ref_count = [0] * self.total_blocks
        self.sequence_blocks = {}
        self.block_hash, self.block_key, self.cached_blocks, self.seq_hashes = {}, {}, {}, {}

    # ---- predicates and queries (never mutate) -------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.total_blocks - len(self.free_blocks)

    @property
    def peak_num_used_blocks(self) -> int:
        """The most blocks held at once since this manager was made."""
        return self.total_blocks - self.min_free_blocks

    @property
    def utilization(self) -> float:
        """Fraction of the pool held by some sequence (0.0 for an empty pool)."""
        return self.num_used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self.free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks ensure_capacity(seq_id, num_tokens) would allocate (an unknown sequence has 0)."""
        return max(0, self.num_blocks_for(num_tokens) - len(self.sequence_blocks.get(seq_id, ())))

    def num_blocks_of(self, seq_id: Hashable) -> int:
        """Blocks the sequence holds (0 for an unknown one)."""
        return len(self.sequence_blocks.get(seq_id, ()))

    def num_committed_blocks(self, seq_id: Hashable) -> int:
        """Leading blocks of the sequence already registered under their hash (commit_full_blocks)."""
        return len(self.seq_hashes.get(seq_id, ()))

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table: physical block ids in logical order."""
        return list(self._table(seq_id))

    def is_shared(self, seq_id: Hashable, block_index: int) -> bool:
        """True when writing into this block needs cow_block to hand out a copy first."""
        return self.ref_count[self._table(seq_id)[self._index(seq_id, block_index)]] > 1

    def can_allocate_prompt(self, token_ids: Sequence[int]) -> bool:
        """Would allocate_prompt succeed now? A hit on a block in use costs nothing; a hit on a
        free (cached) block takes it out of the free list, like a fresh block."""
        return self._fits(self.num_blocks_for(len(token_ids)), self._cache_hits(token_ids))

    def internal_fragmentation(self, seq_lens: dict[Hashable, int]) -> Fragmentation:
        """Allocated token slots minus tokens stored, over the given sequences' block tables.

        seq_lens: seq_id -> tokens stored. A block shared by two sequences counts in each table.
        """
        allocated = stored = 0
        for seq_id, n in seq_lens.items():
            capacity = len(self._table(seq_id)) * self.block_size
            if not 0 <= n <= capacity:
                raise BlockManagerError(f"seq_lens[{seq_id!r}] must be in [0, {capacity}], got {n}")
            allocated, stored = allocated + capacity, stored + n
        wasted = allocated - stored
        return Fragmentation(wasted, allocated, wasted / allocated if allocated else 0.0)

    # ---- the four block operations: allocate, free, share, copy on write ------------------------

    def allocate_blocks(self, seq_id: Hashable, n: int) -> list[int]:
        """Append n fresh blocks to seq_id's table (created if new); returns their ids.
        OutOfBlocksError, with nothing allocated, when fewer than n blocks are free."""
        if not isinstance(n, int) or n < 0:
            raise BlockManagerError(f"n must be an int >= 0, got {n!r}")
        if n > len(self.free_blocks):
            raise OutOfBlocksError(f"need {n} blocks for sequence {seq_id!r}, {len(self.free_blocks)} free")
        new = [self._take_free_block() for _ in range(n)]
        self.sequence_blocks.setdefault(seq_id, array("i")).extend(new)
        return new

    def free_sequence(self, seq_id: Hashable) -> None:
        """Drop the sequence; its blocks whose ref count reaches 0 go to the back of the free list.
        The table is walked backwards so a prefix's first blocks are the last to be evicted."""
        for block in reversed(self._table(seq_id)):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
        del self.sequence_blocks[seq_id]
        self.seq_hashes.pop(seq_id, None)

    def share_prefix(self, source: Hashable, target: Hashable, n_blocks: int) -> None:
        """target's table becomes source's first n_blocks (ref counts +1, no data copied).

        n_blocks may include source's partially filled last block (a fork shares everything).
        target must be new or hold no blocks; it must differ from source."""
        src = self._table(source)
        if not isinstance(n_blocks, int) or not 0 <= n_blocks <= len(src):
            raise BlockManagerError(f"n_blocks must be in [0, {len(src)}] (blocks of {source!r}), got {n_blocks!r}")
        if target == source or self.sequence_blocks.get(target):
            raise BlockManagerError(f"share_prefix target {target!r} must be a new sequence, distinct from the source")
        for block in src[:n_blocks]:
            self.ref_count[block] += 1
        self.sequence_blocks[target] = src[:n_blocks]
        self.seq_hashes[target] = self.seq_hashes.get(source, [])[:n_blocks]

    def cow_block(self, seq_id: Hashable, block_index: int) -> tuple[int, int]:
        """Make block_index of seq_id writable; returns (old_id, new_id).

        Shared block (ref > 1): a fresh block replaces it in this table and the caller copies
        old -> new. Exclusively owned: (id, id), nothing to copy. Either way the caller is about
        to write, so the block it gets back carries no cache hash (a cached block is immutable):
        an exclusively owned hashed block is unregistered. OutOfBlocksError leaves state unchanged."""
        table = self._table(seq_id)
        old = table[self._index(seq_id, block_index)]
        if self.ref_count[old] == 1:
            new = old
            self._drop_hash(old)
        else:
            if not self.free_blocks:
                raise OutOfBlocksError(f"copy-on-write of block {old} for sequence {seq_id!r}: no free block")
            new = self._take_free_block()
            self.ref_count[old] -= 1  # still > 0: the other holders keep it
            table[block_index] = new
        hashes = self.seq_hashes.get(seq_id)
        if hashes is not None:
            del hashes[block_index:]  # this block and later ones are recommitted after the write
        return old, new

    # ---- growth and the prefix cache -----------------------------------------------------------

    def ensure_capacity(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow seq_id's table (created if new) to hold num_tokens tokens; returns the new blocks.
        What the runtime calls every step before writing the step's tokens."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise BlockManagerError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        return self.allocate_blocks(seq_id, self.blocks_needed(seq_id, num_tokens))

    def allocate_prompt(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Allocate ceil(len(token_ids) / block_size) blocks for a new sequence, reusing cached
        full leading blocks; returns num_cached_tokens (a multiple of block_size, < len(token_ids)).

        The last prompt token is always computed, so a prompt whose every block would hit takes
        its last block fresh: no write ever lands in a cached block. Nothing changes on
        OutOfBlocksError. With caching off this is allocate_blocks with 0 cached tokens."""
        if self.sequence_blocks.get(seq_id):
            raise BlockManagerError(f"allocate_prompt: sequence {seq_id!r} already holds blocks")
        if len(token_ids) == 0:
            raise BlockManagerError("allocate_prompt: token_ids must not be empty")
        hits = self._cache_hits(token_ids)
        n_total = self.num_blocks_for(len(token_ids))
        if not self._fits(n_total, hits):
            raise OutOfBlocksError(f"prompt of {len(token_ids)} tokens needs {n_total} blocks "
                                   f"({len(hits)} cached), {len(self.free_blocks)} free")
        for block in hits:  # claim hits before taking fresh blocks, so none of them is evicted
            if self.ref_count[block] == 0:
                del self.free_blocks[block]
            self.ref_count[block] += 1
        fresh = [self._take_free_block() for _ in range(n_total - len(hits))]
        self.min_free_blocks = min(self.min_free_blocks, len(self.free_blocks))     # (hits only: none taken)
        self.sequence_blocks[seq_id] = array("i", hits + fresh)
        self.seq_hashes[seq_id] = [self.block_hash[b] for b in hits]
        if self.enable_prefix_caching:
            self.num_query_tokens += len(token_ids)
            self.num_hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def commit_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """Register the sequence's blocks that are now full under their chain hash.

        token_ids: the sequence's tokens; the first num_tokens of them (default all) have their KV in
        the cache. Idempotent, and incremental: blocks committed before are not hashed again, so each
        block is hashed once, when it fills. A block that is already hashed (a hit, or shared with
        share_prefix) keeps its hash; a block whose hash another block already holds (the same content
        computed twice) stays unregistered."""
        table = self._table(seq_id)
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        if num_tokens > len(table) * self.block_size:
            raise BlockManagerError(f"{num_tokens} tokens exceed the {len(table)} blocks of {seq_id!r}")
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq_id, [])
        bs, first, last = self.block_size, len(hashes), num_tokens // self.block_size
        if first >= last:
            return
        raw = array("q", token_ids[first * bs:last * bs]).tobytes()  # the new full blocks as int64 bytes
        width = 8 * bs
        parent = hashes[-1] if hashes else None
        for i in range(first, last):
            h = hash_block_tokens(parent, raw[(i - first) * width:(i - first + 1) * width])
            block = table[i]
            if block in self.block_hash:
                if self.block_key[block] != (parent, tuple(token_ids[i * bs:(i + 1) * bs])):
                    raise BlockManagerError(f"block {block} of {seq_id!r} is cached with other tokens")
            elif h not in self.cached_blocks:
                key = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
                self.block_hash[block], self.block_key[block], self.cached_blocks[h] = h, key, block
            hashes.append(h)
            parent = h

    # ---- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert every invariant of the state (tests call it after every operation)."""
        holders = [0] * self.total_blocks  # table entries pointing at each block, duplicates counted
        for seq_id, table in self.sequence_blocks.items():
            for block in table:
                assert 0 <= block < self.total_blocks, f"{seq_id!r} holds block {block} out of range"
                holders[block] += 1
        assert all(0 <= b < self.total_blocks for b in self.free_blocks), "free block out of range"
        for block in range(self.total_blocks):
            ref, free = self.ref_count[block], block in self.free_blocks
            assert ref == holders[block], f"block {block}: ref_count {ref} != {holders[block]} holders"
            assert free == (ref == 0), f"block {block}: ref_count {ref} but free={free}"
        assert len(self.free_blocks) + sum(r > 0 for r in self.ref_count) == self.total_blocks
        assert len(self.cached_blocks) == len(self.block_hash) == len(self.block_key)
        for block, h in self.block_hash.items():
            assert self.cached_blocks.get(h) == block, f"block {block}: hash {h} not mapped back to it"
            assert len(self.block_key[block][1]) == self.block_size, f"hashed block {block} is not full"
        for seq_id, hashes in self.seq_hashes.items():
            assert len(hashes) <= len(self.sequence_blocks.get(seq_id, ())), f"{seq_id!r}: stale hashes"

    # ---- helpers -------------------------------------------------------------------------------

    def _table(self, seq_id: Hashable) -> array:
        if seq_id not in self.sequence_blocks:
            raise BlockManagerError(f"unknown sequence {seq_id!r}")
        return self.sequence_blocks[seq_id]

    def _index(self, seq_id: Hashable, block_index: int) -> int:
        n = len(self.sequence_blocks[seq_id])
        if not isinstance(block_index, int) or not 0 <= block_index < n:
            raise BlockManagerError(f"block_index must be in [0, {n}) for {seq_id!r}, got {block_index!r}")
        return block_index

    def _fits(self, n_blocks: int, hits: list[int]) -> bool:
        in_use = sum(1 for b in hits if self.ref_count[b] > 0)  # shared: no free block needed
        return n_blocks - in_use <= len(self.free_blocks)

    def _take_free_block(self) -> int:
        """Pop the least recently freed block; a cached one loses its hash (evicted)."""
        block, _ = self.free_blocks.popitem(last=False)
        self.min_free_blocks = min(self.min_free_blocks, len(self.free_blocks))
        if block in self.block_hash:
            self.num_evictions += 1
            self._drop_hash(block)
        self.ref_count[block] = 1
        return block

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.cached_blocks[h], self.block_key[block]

    def _cache_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks for the prompt's leading full blocks, each confirmed by its
        (parent hash, token ids) key; never the block holding the last prompt token."""
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):  # full blocks before the last token's block
            tokens = token_ids[i * bs:(i + 1) * bs]
            h = hash_block_tokens(parent, tokens)
            block = self.cached_blocks.get(h)
            if block is None or self.block_key[block] != (parent, tuple(tokens)) or block in hits:
                break
            hits.append(block)
            parent = h
        return hits
