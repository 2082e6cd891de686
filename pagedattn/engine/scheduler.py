"""Continuous (iteration-level) batching: which sequences run this step, and how many tokens each.

Every sequence carries `num_computed_tokens` (K/V in the cache) and `num_tokens` (known); a step
computes a chunk of the gap for some of them. Policy, per step:

1. Running sequences, oldest admission first, each get min(gap, budget left) tokens: 1 for a
   decode, a chunk for a prompt still being prefilled. Their blocks grow to cover the chunk, and a
   partial block shared with another sequence (parallel sampling, beams) is copied before the first
   write into it (copy-on-write). When the pool has too few free blocks, the most recently admitted
   running sequence is preempted: its blocks are freed, its computed count drops to 0 and it goes to
   the front of the waiting queue; it is recomputed later (recompute, not swap).
2. Only if nothing was preempted this step, waiting sequences are admitted in arrival order (no
   skipping) while the token budget, `max_num_seqs` (counting the sequences a request will fork
   into) and the pool allow. Admission allocates the blocks of every known token at once; with
   prefix caching, leading full blocks already in the cache are reused and count as computed.

A sequence whose token is still in flight (asynchronous scheduling: the step that samples it has not
returned) is scheduled like any other: the runner reads its id on the device. One whose in-flight token
is its last (max_tokens or max_model_len reached) is not scheduled again.

The step's batch lists prefill chunks (more than one new token) first, then decodes (one new token),
which is the order AttentionMetadata wants. The scheduler never calls the model: the engine runs the
step, then calls `update` to advance the counters and `finish` to retire sequences.
"""
from collections import deque
from dataclasses import dataclass, field

from pagedattn.engine.sequence import SequenceStatus
from pagedattn.errors import InvalidRequestError


@dataclass
class SchedulerConfig:
    """max_num_seqs: sequences in one step; max_num_batched_tokens: tokens in one step (the chunk
    budget); block_size: tokens per KV block."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class SchedulerOutput:
    """One step's work.

    scheduled: (sequence, num_new_tokens) pairs, prefill chunks (num_new_tokens > 1) first, then
        decodes (1); each computes token_ids[num_computed_tokens : num_computed_tokens + n].
    num_prefills: how many leading entries are prefill chunks.
    block_copies: (src_block, dst_block) pairs to copy in every layer before the step (copy-on-write).
    preempted: sequences preempted while scheduling this step.
    """

    scheduled: list = field(default_factory=list)
    num_prefills: int = 0
    block_copies: list = field(default_factory=list)
    preempted: list = field(default_factory=list)

    @property
    def num_batched_tokens(self):
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self):
        return not self.scheduled


class Scheduler:
    """Waiting queue + running list over one BlockManager."""

    def __init__(self, config, block_manager):
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting = deque()     # arrival order; preempted sequences go back to the front
        self.running = []          # admission order; preemption takes from the end
        self.num_preemptions = 0

    # ---- queues -------------------------------------------------------------------------------
    def add(self, seq):
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq):
        """A sequence forked from a running one (it already holds shared blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq, reason):
        """Retire a sequence (finished or aborted) wherever it is, freeing its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_sequence(seq.seq_id)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    @property
    def num_unfinished(self):
        return len(self.waiting) + len(self.running)

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self):
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chosen = []

        # 1. Running sequences, oldest first; make room by preempting the newest.
        i = 0
        while i < len(self.running) and budget > 0 and len(chosen) < self.config.max_num_seqs:
            seq = self.running[i]
            n = min(seq.num_new_tokens, budget)
            if n == 0 or seq.last_token_inflight:   # a beam waiting for its driver; a sampled last token
                i += 1
                continue
            while not self._reserve(seq, n, out.block_copies):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                chosen.append((seq, n))
                budget -= n
                i += 1
                continue
            break               # seq preempted itself: it was the last running sequence

        # 2. Admit waiting sequences, unless this step had to preempt.
        if not out.preempted and self.waiting:
            # Sequences running now or forked later (n > 1, beams): admission keeps them <= max_num_seqs.
            seats = sum(1 + s.num_pending_forks for s in self.running)
            while self.waiting and budget > 0 and len(chosen) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_inflight or seats + 1 + seq.num_pending_forks > self.config.max_num_seqs:
                    break       # (a preempted sequence waits for its last sampled token to reach the host)
                seats += 1 + seq.num_pending_forks
                if not self._can_admit(seq):
                    break
                self.waiting.popleft()
                self._admit(seq)
                n = min(seq.num_new_tokens, budget)
                chosen.append((seq, n))
                budget -= n

        prefills, decodes = [], []
        for pair in chosen:
            (prefills if pair[1] > 1 else decodes).append(pair)
        out.scheduled = prefills + decodes
        out.num_prefills = len(prefills)
        return out

    def update(self, out):
        """After the model ran the step: the scheduled tokens are now in the cache."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
        bm, bs = self.block_manager, self.block_size
        if bm.enable_prefix_caching:
            committed = bm.seq_hashes                   # (bm.num_committed_blocks, without a call per sequence)
            for seq, _ in out.scheduled:
                # blocks whose tokens are all computed and known (an in-flight token is not yet known)
                full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
                if full > len(committed.get(seq.seq_id, ())):
                    bm.commit_full_blocks(seq.seq_id, seq.token_ids, full * bs)

    # ---- blocks ---------------------------------------------------------------------------------
    def _can_admit(self, seq):
        return self.block_manager.can_allocate_prompt(seq.token_ids)

    def _admit(self, seq):
        """Blocks for every known token; the prefix cache (when on) supplies leading full blocks,
        which then count as computed. The last known token is always computed."""
        seq.num_cached_tokens = self.block_manager.allocate_prompt(seq.seq_id, seq.token_ids)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _reserve(self, seq, n, block_copies):
        """Make seq's blocks cover its next n tokens; copy a shared partial block it will write.
        Returns False (changing nothing) when the pool is too small."""
        bm, bs = self.block_manager, self.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        table = bm.sequence_blocks.get(seq.seq_id)
        if table is not None and end <= len(table) * bs and (start % bs == 0 or bm.ref_count[table[start // bs]] == 1):
            return True         # most decode steps: room in the last block, which this sequence alone holds
        num_blocks = bm.num_blocks_of(seq.seq_id)
        new_blocks = bm.blocks_needed(seq.seq_id, end)
        first = start // self.block_size
        cow = start % self.block_size != 0 and first < num_blocks and bm.is_shared(seq.seq_id, first)
        if not bm.can_allocate(new_blocks + int(cow)):
            return False
        if cow:
            old, new = bm.cow_block(seq.seq_id, first)
            if old != new:
                block_copies.append((old, new))
        if new_blocks:
            bm.ensure_capacity(seq.seq_id, end)
        return True

    def _preempt(self, seq):
        self.block_manager.free_sequence(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
