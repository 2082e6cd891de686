"""Per-request latency metrics as plain numbers, and the bytes a model's weights hold.

Request: time to first token (TTFT = first token time - arrival), inter-token latency (ITL, the
gaps between consecutive tokens of one sequence), token counts, prefix-cache hit, preemptions.
The engine's own counters (KV usage, fragmentation, throughput, ...) are LLMEngine.metrics().
"""
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generated_tokens: int     # over all n completions
    num_cached_tokens: int        # prompt tokens the prefix cache served (last admission)
    num_preemptions: int
    ttft: float | None            # seconds
    mean_itl: float | None        # seconds, mean gap between consecutive tokens of a completion

    def as_dict(self):
        return asdict(self)


def request_metrics(group, now):
    seqs = group.seqs
    gaps = [g for s in seqs for g in s.token_latencies]
    first = group.first_token_time
    return RequestMetrics(
        arrival_time=group.arrival_time,
        first_token_time=first,
        finished_time=now,
        num_prompt_tokens=len(group.prompt_token_ids),
        num_generated_tokens=sum(s.num_output_tokens for s in seqs),
        num_cached_tokens=seqs[0].num_cached_tokens if seqs else 0,
        num_preemptions=sum(s.num_preemptions for s in seqs),
        ttft=None if first is None else first - group.arrival_time,
        mean_itl=sum(gaps) / len(gaps) if gaps else None,
    )


def model_weight_bytes(model):
    """Bytes of the model's weights: its tensors (each shared one once) plus the GGUF blocks of the layers
    that hold them (QuantWeight.nbytes, the file's bytes). Buffers (the rotary cos/sin cache) excluded."""
    seen, total = set(), 0
    for module in model.modules():
        for value in list(module._parameters.values()) + [module.__dict__.get("weight")]:
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif hasattr(value, "nbytes"):
                total += value.nbytes
    return total


now = time.perf_counter
