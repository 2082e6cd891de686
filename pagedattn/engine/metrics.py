"""Per-request latency metrics and engine-wide counters, as plain numbers.

Request: time to first token (TTFT = first token time - arrival), inter-token latency (ITL, the
gaps between consecutive tokens of one sequence), token counts, prefix-cache hit, preemptions.
Engine: KV usage, internal fragmentation, prefix-cache hit rate (tokens), preemptions,
running/waiting counts, throughput (generated tokens / seconds spent in steps). Model: the bytes its
weights hold (`model_weight_bytes`).
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


class EngineStats:
    """Counters the engine bumps every step."""

    def __init__(self):
        self.num_steps = 0
        self.num_computed_tokens = 0     # tokens run through the model (prefill chunks + decodes)
        self.num_generated_tokens = 0
        self.num_finished_requests = 0
        self.step_time = 0.0             # seconds inside step()
        self.peak_kv_usage = 0.0
        self.ttfts, self.itls = [], []

    def record_step(self, num_tokens, num_generated, seconds, kv_usage):
        self.num_steps += 1
        self.num_computed_tokens += num_tokens
        self.num_generated_tokens += num_generated
        self.step_time += seconds
        self.peak_kv_usage = max(self.peak_kv_usage, kv_usage)

    def record_request(self, metrics):
        self.num_finished_requests += 1
        if metrics.ttft is not None:
            self.ttfts.append(metrics.ttft)
        if metrics.mean_itl is not None:
            self.itls.append(metrics.mean_itl)

    def as_dict(self):
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {
            "num_steps": self.num_steps,
            "num_computed_tokens": self.num_computed_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_finished_requests": self.num_finished_requests,
            "step_time_s": self.step_time,
            "generation_throughput_tok_s": self.num_generated_tokens / self.step_time if self.step_time else 0.0,
            "total_throughput_tok_s": self.num_computed_tokens / self.step_time if self.step_time else 0.0,
            "peak_kv_usage": self.peak_kv_usage,
            "mean_ttft_s": mean(self.ttfts),
            "mean_itl_s": mean(self.itls),
        }


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
