"""Pack one scheduled step into tensors, run the model on the paged KV cache, return logits.

For a step with sequences s (prefill chunks first, then decodes), each computing its tokens
[start_s, end_s):

    input_ids     [T] int64   token_ids[start_s:end_s], concatenated
    positions     [T] int64   start_s .. end_s - 1, concatenated
    slot_mapping  [T] int64   block_table_s[pos // block_size] * block_size + pos % block_size
    context_lens  [S] int32   end_s (tokens in the cache after this step's write)
    block_tables  [S, W] int32, padded with 0
    cu_seqlens_q  [P + 1] int32, the prefill chunks' boundaries

Host work is one short loop over sequences (slicing token lists, collecting block tables); every
per-token quantity is computed with tensor ops. Logits are computed only for the last token of
each sequence that has caught up with its known tokens (the ones that sample this step).

`execute` is the eager path; a CUDA-graph decode path can wrap `prepare`'s tensors later in its
own module without changing this one.
"""
from dataclasses import dataclass

import torch

from pagedattn.attention import AttentionMetadata


@dataclass
class PreparedStep:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor   # [N] int64, rows of the hidden states to turn into logits
    sampling_seqs: list            # the N sequences those rows belong to


class ModelRunner:
    """model: Qwen2ForCausalLM; kv_cache: KVCache; block_manager: for block tables."""

    def __init__(self, model, kv_cache, block_manager, device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.block_size = kv_cache.block_size
        self.device = torch.device(device)

    def copy_blocks(self, block_copies):
        """Copy-on-write: copy src -> dst in every layer before the step writes into dst."""
        if not block_copies:
            return
        if self.device.type == "cuda":
            from kernels_numba.cache_ops import copy_blocks
            mapping = torch.tensor(block_copies, dtype=torch.int64, device=self.device)
            copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches, mapping)
        else:
            self.kv_cache.copy_blocks(block_copies)

    def prepare(self, sched_out):
        """Tensors for one SchedulerOutput (see the module docstring)."""
        bs = self.block_size
        input_ids, starts, q_lens, tables, sampling_seqs, last_rows = [], [], [], [], [], []
        offset = 0
        for seq, n in sched_out.scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            starts.append(start)
            q_lens.append(n)
            tables.append(self.block_manager.block_table(seq.seq_id))
            offset += n
            if start + n == seq.num_tokens:          # caught up: this token's logits give the next one
                sampling_seqs.append(seq)
                last_rows.append(offset - 1)
        num_seqs, num_tokens = len(q_lens), offset
        width = max(len(t) for t in tables)
        table_rows = [list(t) + [0] * (width - len(t)) for t in tables]

        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)                        # (S,)
        starts_t = torch.tensor(starts, dtype=torch.int64)                        # (S,)
        block_tables = torch.tensor(table_rows, dtype=torch.int64).view(num_seqs, width)
        cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
        cu[1:] = q_lens_t.cumsum(0)                                               # (S+1,)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)  # (T,)
        positions = torch.arange(num_tokens) - cu[seq_of_token] + starts_t[seq_of_token]
        blocks = block_tables[seq_of_token, positions // bs]                      # (T,)
        slot_mapping = blocks * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            num_prefills=sched_out.num_prefills,
            num_prefill_tokens=int(cu[sched_out.num_prefills]),
            num_decode_tokens=num_seqs - sched_out.num_prefills,
            slot_mapping=slot_mapping.to(dev),
            context_lens=(starts_t + q_lens_t).to(device=dev, dtype=torch.int32),
            block_tables=block_tables.to(device=dev, dtype=torch.int32),
            cu_seqlens_q=cu[:sched_out.num_prefills + 1].to(device=dev, dtype=torch.int32),
        )
        return PreparedStep(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev),
            positions=positions.to(dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(last_rows, dtype=torch.int64).to(dev),
            sampling_seqs=sampling_seqs,
        )

    @torch.inference_mode()
    def execute(self, sched_out):
        """Run one step. Returns (logits [N, vocab] float32, the N sequences that sample)."""
        self.copy_blocks(sched_out.block_copies)
        step = self.prepare(sched_out)
        hidden = self.model.forward(step.input_ids, step.positions, self.kv_cache, step.attn_metadata)
        if not step.sampling_seqs:
            return None, []
        logits = self.model.compute_logits(hidden[step.logits_indices])
        return logits, step.sampling_seqs
