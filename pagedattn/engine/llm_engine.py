"""LLMEngine: requests in, one scheduler step at a time, finished outputs out.

    engine = LLMEngine(EngineConfig(model="path/to/qwen2_dir", device="cpu"))
    engine.add_request("r0", "def fib(n):", SamplingParams(temperature=0, max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutputs of requests that finished this step
            print(out.outputs[0].text)

One step = schedule (Scheduler) -> copy-on-write copies + pack + model + logits (ModelRunner) ->
advance computed counters -> sample the sequences that caught up -> stop checks -> free finished
sequences. Requests may be added or aborted between any two steps (continuous batching).

Every request is validated by `add_request` before any state changes (InvalidRequestError naming
the field and its allowed range), so a bad request never disturbs the running ones.
"""
import itertools
import json
import os
from dataclasses import dataclass

import torch

from pagedattn.block_manager import BlockManager
from pagedattn.engine.metrics import EngineStats, now, request_metrics
from pagedattn.engine.model_runner import ModelRunner
from pagedattn.engine.scheduler import Scheduler, SchedulerConfig
from pagedattn.engine.sequence import Sequence, SequenceGroup, make_generator
from pagedattn.errors import InvalidRequestError, ModelLoadError
from pagedattn.kv_cache import KVCache
from pagedattn.layers.sampler import sample
from pagedattn.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class EngineConfig:
    """Everything LLM(...) accepts.

    model: HF Qwen2 directory; None = the bundled Qwen2.5-Coder-0.5B-Instruct.
    device: "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ...
    dtype: "auto" (float16 on CUDA, float32 on CPU) or float32 / float16 / bfloat16 (str or torch.dtype).
    block_size: tokens per KV block. num_blocks: KV pool size; None = sized from memory (see
        `auto_num_blocks`). max_model_len: prompt + generated tokens per sequence (capped at the
        model's max_position_embeddings). max_num_seqs / max_num_batched_tokens: per-step caps
        (default token budget: 2048 on CPU, 8192 on CUDA).
    enable_prefix_caching: reuse the KV of identical leading prompt blocks across requests.
    attn_backend: "auto" / "torch" / "numba". enforce_eager: no CUDA graphs (pure-decode steps on CUDA
        otherwise replay captured graphs; see pagedattn.engine.cuda_graph).
    gpu_memory_utilization: fraction of free GPU memory the KV pool may take (after a reserve).
    cpu_kv_cache_fraction: fraction of available host memory the KV pool may take on CPU.
    """

    model: str | None = None
    device: str = "auto"
    dtype: object = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    attn_backend: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.1

    def __post_init__(self):
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError(f"device={self.device!r} but no CUDA GPU is available (use 'cpu' or 'auto')")
        if self.dtype == "auto":
            self.dtype = torch.float16 if torch.device(self.device).type == "cuda" else torch.float32
        elif isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise InvalidRequestError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
            self.dtype = _DTYPES[self.dtype]
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InvalidRequestError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if torch.device(self.device).type == "cuda" else 2048
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_blocks is not None and (isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 1):
            raise InvalidRequestError(f"num_blocks must be None (size from memory) or an int >= 1, got {self.num_blocks!r}")
        for name in ("gpu_memory_utilization", "cpu_kv_cache_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidRequestError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")


@dataclass
class CompletionOutput:
    index: int                     # which of the request's n completions
    text: str                      # detokenized, special tokens skipped, stop string removed
    token_ids: list                # generated ids (an EOS / stop token id that ended it included)
    finish_reason: str | None      # "stop" | "length" | "abort"
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: object
    prompt: object                 # the string given, or None for token ids
    prompt_token_ids: list
    outputs: list                  # [CompletionOutput], ordered by index
    finished: bool = True
    metrics: object = None         # RequestMetrics
    num_cached_tokens: int = 0


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from pagedattn.models.loader import load_model

        self.config = config
        path = config.model
        if path is None:
            from pagedattn.bundled import bundled_model_path
            path = bundled_model_path()
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ModelLoadError(f"model path {path!r} does not exist or is not a directory")
        self.model_path = path
        self.device = torch.device(config.device)
        self.model, self.model_config = load_model(path, self.device, config.dtype, config.attn_backend)
        self.tokenizer = self._load_tokenizer(path)
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = min(config.max_model_len, self.model_config.max_position_embeddings)
        gen = _read_json(os.path.join(path, "generation_config.json"))
        eos = set(_as_list(gen.get("eos_token_id"))) | set(_as_list(self.model_config.eos_token_id))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos

        mc = self.model_config
        self.bytes_per_block = KVCache.bytes_per_block_of(mc.num_hidden_layers, mc.num_key_value_heads,
                                                          config.block_size, mc.head_dim, config.dtype)
        num_blocks = config.num_blocks or self.auto_num_blocks()
        self.kv_cache = KVCache(mc.num_hidden_layers, num_blocks, mc.num_key_value_heads, config.block_size,
                                mc.head_dim, dtype=config.dtype, device=str(self.device))
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.block_size), self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.device,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager)
        self.groups = {}                   # request_id -> SequenceGroup, unfinished requests
        self.seq_ids = itertools.count()
        self.stats = EngineStats()
        self._frag_sum, self._frag_n = 0.0, 0
        self.deferred_outputs = []         # finished while a beam search drove the steps; returned next step

    # ---- set-up ---------------------------------------------------------------------------------
    @staticmethod
    def _load_tokenizer(path):
        files = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
        if not any(os.path.isfile(os.path.join(path, f)) for f in files):
            return None                    # e.g. a random test checkpoint: token ids only
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    def auto_num_blocks(self):
        """KV pool size when num_blocks is None.

        CUDA: (free memory x gpu_memory_utilization - a reserve for activations and logits)
        / bytes per block. CPU: enough for max_num_seqs full-length sequences, capped at
        cpu_kv_cache_fraction of the available host memory (MemAvailable) and at 4 GiB.
        """
        cfg, mc = self.config, self.model_config
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            itemsize = torch.empty((), dtype=cfg.dtype).element_size()
            reserve = (cfg.max_num_batched_tokens * (mc.hidden_size * 8 + mc.intermediate_size * 3) * itemsize
                       + cfg.max_num_seqs * mc.vocab_size * 4 * 2 + (512 << 20))
            budget = free * cfg.gpu_memory_utilization - reserve
        else:
            wanted = -(-cfg.max_num_seqs * self.max_model_len // cfg.block_size) * self.bytes_per_block
            budget = min(wanted, cfg.cpu_kv_cache_fraction * _available_host_memory(), 4 << 30)
        num_blocks = int(budget // self.bytes_per_block)
        need = -(-self.max_model_len // cfg.block_size)
        if num_blocks < need:
            raise InvalidRequestError(f"not enough memory for one max_model_len={self.max_model_len} sequence: "
                                      f"{num_blocks} KV blocks fit, {need} needed (lower max_model_len or set num_blocks)")
        return num_blocks

    @property
    def num_blocks(self):
        return self.block_manager.total_blocks

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"prompt is a string but {self.model_path!r} has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise InvalidRequestError(f"prompt token ids must be ints, got {t!r} at position {i}")
            return ids
        raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def validate_request(self, prompt, params, beam_width=1):
        """Token ids of `prompt` after checking it and `params` against the model and the pool.
        Raises InvalidRequestError naming the field and its allowed range; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        n_prompt, max_len = len(ids), self.max_model_len
        if n_prompt == 0:
            raise InvalidRequestError("prompt is empty: it must have at least 1 token")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {ids[bad]} at position {bad} is outside the vocabulary: "
                                      f"token ids must be in [0, {self.vocab_size})")
        if n_prompt > max_len:
            raise InvalidRequestError(f"prompt has {n_prompt} tokens: the prompt length must be <= "
                                      f"max_model_len={max_len}")
        if n_prompt + params.max_tokens > max_len:
            raise InvalidRequestError(f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                      f"max_model_len={max_len}: max_tokens must be in [1, {max_len - n_prompt}]")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} must be in [1, max_num_seqs={self.config.max_num_seqs}]")
        if beam_width > self.config.max_num_seqs:
            raise InvalidRequestError(f"beam_width={beam_width} must be in [1, max_num_seqs={self.config.max_num_seqs}]")
        blocks = -(-(n_prompt + params.max_tokens) // self.config.block_size) * beam_width
        if blocks > self.num_blocks:
            what = f"{beam_width} beams x " if beam_width > 1 else ""
            raise InvalidRequestError(
                f"request can never fit the KV pool: prompt ({n_prompt}) + max_tokens ({params.max_tokens}) needs "
                f"{what}{blocks // beam_width} blocks of {self.config.block_size} tokens but num_blocks={self.num_blocks}; "
                f"max_tokens must be <= {self.num_blocks // beam_width * self.config.block_size - n_prompt}")
        return ids

    def add_request(self, request_id, prompt, params=None, arrival_time=None, prompt_token_ids=None):
        """Queue a request (validated first). prompt: str or token ids. Returns the SequenceGroup."""
        params = SamplingParams() if params is None else params
        if request_id in self.groups:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate_request(prompt, params)
        arrival = now() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, prompt if isinstance(prompt, str) else None, ids, params, arrival)
        seq = Sequence(next(self.seq_ids), request_id, ids, len(ids), params, 0, arrival,
                       make_generator(params.seed, 0))
        seq.num_pending_forks = params.n - 1
        group.seqs.append(seq)
        self.groups[request_id] = group
        self.scheduler.add(seq)
        return group

    def add_beam_root(self, request_id, prompt_token_ids, beam_width=1):
        """A beam-search request's first sequence (params None: its logits go to the driver as
        log-probabilities in `seq.logprobs` instead of being sampled)."""
        arrival = now()
        group = SequenceGroup(request_id, None, prompt_token_ids, None, arrival)
        seq = Sequence(next(self.seq_ids), request_id, prompt_token_ids, len(prompt_token_ids), None, 0, arrival)
        seq.num_pending_forks = beam_width - 1
        group.seqs.append(seq)
        self.groups[request_id] = group
        self.scheduler.add(seq)
        return group

    def fork(self, parent, index, generator=None):
        """A new sequence sharing all of parent's blocks (copy-on-write on the first write)."""
        child = parent.fork(next(self.seq_ids), index, generator)
        if parent.seq_id in self.block_manager.sequence_blocks:
            self.block_manager.share_prefix(parent.seq_id, child.seq_id,
                                            len(self.block_manager.block_table(parent.seq_id)))
            self.scheduler.add_running(child)
        else:                               # parent preempted: the child recomputes too
            child.num_computed_tokens = 0
            self.scheduler.add(child)
        self.groups[parent.request_id].seqs.append(child)
        return child

    def free_sequence(self, seq, reason="abort"):
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)

    def abort_request(self, request_id):
        """Stop a request wherever it is and free its blocks. Returns False if it is unknown."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            self.free_sequence(seq, "abort")
        return True

    def has_unfinished_requests(self):
        return bool(self.groups or self.deferred_outputs)

    # ---- the step -------------------------------------------------------------------------------
    def step(self):
        """Run one scheduler step. Returns RequestOutputs of the requests that finished in it (and of
        any that finished while `beam_search` was driving the engine)."""
        t0 = now()
        deferred, self.deferred_outputs = self.deferred_outputs, []
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.scheduler.waiting and not any(s.num_new_tokens for s in self.scheduler.running):
                raise RuntimeError(f"no progress possible: {len(self.scheduler.waiting)} sequences wait for blocks "
                                   f"that {len(self.scheduler.running)} paused sequences hold")
            return deferred
        logits, seqs = self.runner.execute(out)
        self.scheduler.update(out)
        t = now()
        finished = self._process(logits, seqs, t) if seqs else []
        num_generated = sum(1 for s in seqs if s.params is not None)
        self.stats.record_step(out.num_batched_tokens, num_generated, now() - t0, self.block_manager.utilization)
        self._sample_fragmentation()
        return deferred + finished

    def _process(self, logits, seqs, t):
        rows, to_sample = [], []
        for i, seq in enumerate(seqs):
            if seq.params is None:                       # beam search: the driver picks tokens
                seq.logprobs = logits[i].log_softmax(-1)
                continue
            group = self.groups[seq.request_id]
            rows.append(i)
            to_sample.append(seq)
            if not group.forked:                         # n > 1: fork the others off the prefilled prompt
                group.forked = True
                seq.num_pending_forks = 0
                for j in range(1, seq.params.n):
                    rows.append(i)
                    to_sample.append(self.fork(seq, j, make_generator(seq.params.seed, j)))
        if not to_sample:
            return []
        tokens = sample(logits[rows], [s.params for s in to_sample], [s.generator for s in to_sample]).tolist()
        done = []
        for seq, token in zip(to_sample, tokens):
            seq.append_token(token, t)
            reason = self._stop_reason(seq)
            if reason is not None:
                if seq.text is None:             # (a stop string already cut the text)
                    seq.text = self.detokenize(seq.output_token_ids)
                self.scheduler.finish(seq, reason)
                group = self.groups[seq.request_id]
                if group.is_finished and group not in done:
                    done.append(group)
        return [self._finish_group(g, t) for g in done]

    def _stop_reason(self, seq):
        p, token = seq.params, seq.token_ids[-1]
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.detokenize(seq.output_token_ids)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.text = text[:min(hits)]
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def detokenize(self, token_ids):
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _finish_group(self, group, t):
        del self.groups[group.request_id]
        metrics = request_metrics(group, t)
        self.stats.record_request(metrics)
        outputs = [CompletionOutput(s.index, s.text or "", s.output_token_ids, s.finish_reason)
                   for s in sorted(group.seqs, key=lambda s: s.index)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, True, metrics,
                             metrics.num_cached_tokens)

    # ---- metrics --------------------------------------------------------------------------------
    def _fragmentation(self):
        bm = self.block_manager
        lens = {s.seq_id: min(s.num_tokens, len(bm.sequence_blocks[s.seq_id]) * bm.block_size)
                for s in self.scheduler.running}
        return bm.internal_fragmentation(lens)

    def _sample_fragmentation(self):
        if self.scheduler.running:
            self._frag_sum += self._fragmentation().ratio
            self._frag_n += 1

    def metrics(self):
        """Engine metrics as a flat dict (see docs/engine.md)."""
        bm = self.block_manager
        frag = self._fragmentation()
        return {
            "num_blocks": bm.total_blocks,
            "block_size": bm.block_size,
            "num_free_blocks": bm.num_free_blocks,
            "kv_cache_usage": bm.utilization,
            "kv_fragmentation": frag.ratio,
            "mean_kv_fragmentation": self._frag_sum / self._frag_n if self._frag_n else 0.0,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queried_tokens": bm.num_query_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **self.stats.as_dict(),
        }


def _available_host_memory():
    """MemAvailable from /proc/meminfo in bytes (total physical memory where that is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
