"""LLMEngine: requests in, one scheduler step at a time, RequestOutputs out.

    engine = LLMEngine(EngineConfig(model="path/to/qwen2_dir", device="cpu"))
    engine.add_request("r0", "def fib(n):", SamplingParams(temperature=0, max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():          # finished requests (and streamed ones' progress)
            print(out.outputs[0].text)

One step: schedule (Scheduler) -> plan which rows sample -> pack (step_inputs) -> execute on every rank
(the ModelRunner, on every rank: copy-on-write copies, forward, sampling on the device) -> the sampled tokens back on the host ->
append, stop checks, beam search, forks for n > 1 (OutputProcessor, BeamState) -> RequestOutputs.
Requests may be added or aborted between any two steps (continuous batching).

One request, one fate: a request whose row goes wrong after the step (a sampled token outside the
vocabulary, its detokenizer or stop check raising, its beam search failing) finishes alone with an error
(`fail_request`: finish_reason "error", RequestOutput.error), its blocks freed; the other requests of the
batch carry on. A step that raises as a whole (the forward itself) cannot say whose row broke it: the
caller decides (the serving engine core fails the requests in flight and keeps serving).

With async_scheduling (on CUDA by default), step() launches step N+1 before it processes step N's tokens, so the host's
scheduling and packing overlap the GPU's work: a sequence's in-flight token is read on the device
(pagedattn.engine.sequence), a sequence that step N finished still computed one wasted row in step N+1,
and its tokens from then on are dropped; the tokens and finish reasons are exactly the serial engine's.
"""
import concurrent.futures
import gc
import itertools
import json
import logging
import os
import time
from collections import namedtuple

import numpy as np

from pagedattn.block_manager import BlockManager
from pagedattn.engine.beam_search import BeamState
from pagedattn.engine.model_runner import start_runner
from pagedattn.engine.metrics import now
from pagedattn.engine.output_processor import OutputProcessor
from pagedattn.engine.outputs import CompletionOutput, RequestOutput, StepDeltas
from pagedattn.engine.requests import InputProcessor
from pagedattn.engine.scheduler import Scheduler, SchedulerConfig
from pagedattn.engine.sequence import Sequence, SequenceGroup
from pagedattn.engine.step_inputs import SampleRow, build_step_inputs
from pagedattn.engine.tokenizer import load_tokenizer  # noqa: F401 - also the serving side's import
from pagedattn.errors import InvalidRequestError, ModelLoadError
from pagedattn.sampling_params import SamplingParams

logger = logging.getLogger("pagedattn.engine")
startup_log = logging.getLogger("pagedattn.startup")

# mean_kv_fragmentation averages the fragmentation of every this-many-th step with running sequences
FRAGMENTATION_EVERY = 8


def timed(fn, *args):
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t

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


def request_key(engine_seed, serial):
    """A 64-bit random key for an unseeded request: splitmix64 of (engine seed, request serial)."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + (serial + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class EngineStats:
    """Counters the engine bumps every step (LLMEngine.step) and per finished request."""

    def __init__(self):
        self.num_steps = 0
        self.num_computed_tokens = 0     # tokens run through the model (prefill chunks + decodes)
        self.num_generated_tokens = 0
        self.num_finished_requests = 0
        self.step_time = 0.0             # seconds inside step()
        self.frag_sum, self.frag_n = 0.0, 0      # mean_kv_fragmentation's samples
        self.frag_steps = 0                      # steps with running sequences (every FRAGMENTATION_EVERY-th sampled)
        self.ttfts, self.itls = [], []

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
            "mean_ttft_s": mean(self.ttfts),
            "mean_itl_s": mean(self.itls),
        }


# What a launched step samples: num_tokens it computes, its SampleRows and beam rows, in row order.
_Plan = namedtuple("_Plan", "num_tokens sample_rows beam_rows")


def _note_invariant_products():
    """After the warm-up of a GPU batch-invariant engine: a warning when some product was checked to need the
    128-row pieces (cuBLAS split K in this process: a GEMM ran before the engine could give it no workspace)."""
    from pagedattn.layers.ops import NO_SPLIT_K, InvariantLinear

    pieces = sorted({(key[2], key[6]) for key, one_call in InvariantLinear.checked.items() if not one_call})
    if pieces:
        shapes = ", ".join(f"{tuple(shape)} at {m} rows" for shape, m in pieces[:4])
        startup_log.warning(
            f"batch_invariant: {len(pieces)} product shape(s) run in 128-row pieces (slower: {shapes}"
            f"{', ...' if len(pieces) > 4 else ''}): cuBLAS splits K in this process, where a GEMM ran before "
            "the engine; start it with " + " ".join(f"{k}={v}" for k, v in NO_SPLIT_K.items()))


class LLMEngine:
    def __init__(self, config):
        config = config.with_model_path(config.model)
        if not os.path.isdir(config.model):
            raise ModelLoadError(f"model path {config.model!r} does not exist or is not a directory")
        self.config, self.model_path = config, config.model
        times = {}
        # The tokenizer loads on a thread while the weights load, and, when it is not ready by then (its first
        # load on a machine goes through transformers: seconds), while the warm-up compiles and runs too: the
        # warm-up's requests are token ids and nothing it launches depends on the tokenizer.
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            tokenizer = pool.submit(timed, load_tokenizer, config.model)
            startup_log.info("loading the model ...")
            t = time.perf_counter()
            self.runner = start_runner(config)
            times["load_model"] = time.perf_counter() - t
            mc = self.model_config = self.runner.model_config
            self.vocab_size = mc.vocab_size
            self.max_model_len = min(config.max_model_len, mc.max_position_embeddings)
            gen = _read_json(os.path.join(config.model, "generation_config.json"))
            self._config_eos = set(_as_list(gen.get("eos_token_id"))) | set(_as_list(mc.eos_token_id))
            later = config.warmup and not tokenizer.done()
            self._set_tokenizer(None if later else tokenizer.result()[0])
            if config.warmup:
                from pagedattn.engine.warmup import warm_up
                times.update(warm_up(self))
            if later:
                self._set_tokenizer(tokenizer.result()[0])
            times["load_tokenizer"] = tokenizer.result()[1]
            if config.batch_invariant and config.device_type == "cuda":
                _note_invariant_products()
        except BaseException:
            self._shutdown_quietly()
            raise
        finally:
            pool.shutdown(wait=False)
        self.startup_times = times

    def _set_tokenizer(self, tokenizer):
        """The tokenizer and what depends on it (the end-of-sequence ids, the input processor); a fresh
        request state."""
        self.tokenizer = tokenizer
        eos = set(self._config_eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.inputs = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, self.config.max_num_seqs,
                                     self.config.block_size, self.runner.num_blocks, self.config.model)
        self.reset_state()

    def _shutdown_quietly(self):
        """shutdown() of a half-built engine (its runner may not exist yet); errors are not raised over the
        one that stopped the build."""
        if getattr(self, "runner", None) is None:
            return
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("shutting down a half-built engine failed")

    def reset_state(self):
        """A fresh request state: no requests, an empty prefix cache, zeroed statistics (the KV pool's
        contents, the model and the captured graphs stay). The warm-up ends with it."""
        config = self.config
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.block_size), self.block_manager)
        self.groups = {}                   # request_id -> SequenceGroup, unfinished requests
        self.seq_ids = itertools.count()
        self.serials = itertools.count()   # unseeded requests' random keys
        self.pending = None                # (plan, StepResult) of the step in flight (async scheduling)
        self.deferred = []                 # other callers' outputs met by a blocking LLM call; next step's
        self.stats = EngineStats()

    @property
    def num_blocks(self):
        return self.block_manager.total_blocks

    @property
    def model(self):
        return self.runner.model

    @property
    def kv_cache(self):
        """Rank 0's KV pool (with tensor parallelism: its share of the KV heads of every block)."""
        return self.runner.kv_cache

    def shutdown(self):
        """Stop the workers and give back the model, the KV pool, the CUDA graphs and this engine's kernel
        scratch (LLM.close, the end of `with LLM(...)`, and a collected LLM call it); idempotent. The
        engine keeps its requests' bookkeeping; a step after it raises."""
        self.pending = None                # the step in flight's pinned buffers and event
        self.runner.close()
        gc.collect()                       # the graphs, held in reference cycles, give their memory back now

    # ---- requests -------------------------------------------------------------------------------
    def validate_request(self, prompt, params):
        """Token ids of `prompt` after checking it and `params` against the model and the pool."""
        return self.inputs.validate(prompt, params)

    def _new_group(self, request_id, prompt, params, ids, arrival_time, key, stream):
        if request_id in self.groups:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        arrival = now() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, prompt if isinstance(prompt, str) else None, ids, params, arrival, key,
                              stream)
        seq = Sequence(next(self.seq_ids), request_id, ids, len(ids), params, 0, arrival, key)
        group.seqs.append(seq)
        return group, seq

    def add_request(self, request_id, prompt, params=None, arrival_time=None, prompt_token_ids=None, stream=False):
        """Queue a request (validated first; InvalidRequestError names the field). prompt: str or token ids.
        stream: also return its progress from every step that adds to it. Returns the SequenceGroup."""
        params = SamplingParams() if params is None else params
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate_request(prompt, params)
        key = params.seed if params.seed is not None else request_key(self.config.seed, next(self.serials))
        group, seq = self._new_group(request_id, prompt, params, ids, arrival_time, key, stream)
        seq.num_pending_forks = params.n - 1
        self.outputs.init_sequence(seq, stream)
        self.groups[request_id] = group
        self.scheduler.add(seq)
        return group

    def add_beam_request(self, request_id, prompt, params, prompt_token_ids=None):
        """Queue a beam-search request (BeamSearchParams). Its output's completions are the beam_width best
        hypotheses, best first; group.beam holds their scores."""
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate_request(prompt, params)
        group, seq = self._new_group(request_id, prompt, None, ids, None, 0, False)
        seq.num_pending_forks = params.beam_width - 1
        group.beam = BeamState(params, seq)
        self.groups[request_id] = group
        self.scheduler.add(seq)
        return group

    def fork(self, parent, index):
        """A new sequence sharing the blocks of parent's computed tokens (copy-on-write on the first write)."""
        child = parent.fork(next(self.seq_ids), index)
        if parent.seq_id in self.block_manager.sequence_blocks:
            n_blocks = self.block_manager.num_blocks_for(child.num_computed_tokens)
            self.block_manager.share_prefix(parent.seq_id, child.seq_id, n_blocks)
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
        """Requests still running (or outputs not yet handed out). A step still in flight once every
        request finished holds only dropped rows; the next step() collects it."""
        return bool(self.groups or self.deferred)

    def defer(self, output):
        """Hand a RequestOutput back to whoever calls step() next (LLM.generate drives the engine for its own
        requests only; outputs of requests added by others reach them through this)."""
        self.deferred.append(output)

    # ---- the step -------------------------------------------------------------------------------
    def step(self):
        """Run one step. Returns RequestOutputs: every request that finished, and the progress of streamed
        requests that got tokens. With async scheduling they are those of the step launched by the
        previous call (not while a beam search runs: its driver needs each step's candidates at once)."""
        t0 = now()
        overlap = self.config.async_scheduling and not any(g.beam is not None for g in self.groups.values())
        outputs, generated, self.deferred = self.deferred, 0, []
        if self.pending is not None and not overlap:
            outs, generated = self._process(*self.pending)
            outputs += outs
            self.pending = None
        launched = self._launch()
        done = [self.pending] if self.pending is not None else []     # the previous step, while this one runs
        self.pending = None
        if launched is not None:
            if overlap:
                self.pending = launched
            else:
                done.append(launched)
        for plan, result in done:
            outs, n = self._process(plan, result)
            outputs += outs
            generated += n
        stats = self.stats
        stats.num_steps += 1
        stats.num_computed_tokens += launched[0].num_tokens if launched else 0
        stats.num_generated_tokens += generated
        stats.step_time += now() - t0
        if self.scheduler.running:
            if stats.frag_steps % FRAGMENTATION_EVERY == 0:
                # mean_kv_fragmentation's sample: a pass over every running sequence's table (~5% of a
                # 256-sequence decode step's host work if taken every step)
                stats.frag_sum += self._fragmentation().ratio
                stats.frag_n += 1
            stats.frag_steps += 1
        return outputs

    def _launch(self):
        """Schedule, plan and launch a step. Returns (plan, result) or None when nothing ran."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            if (self.pending is None and self.scheduler.waiting
                    and not any(s.num_new_tokens for s in self.scheduler.running)):
                raise RuntimeError(f"no progress possible: {len(self.scheduler.waiting)} sequences wait for blocks "
                                   f"that {len(self.scheduler.running)} paused sequences hold")
            return None
        sample_rows, beam_rows = [], []
        for seq, n in out.scheduled:
            if seq.num_computed_tokens + n != seq.num_tokens:       # a prompt chunk that does not finish it
                continue
            if seq.params is None:
                beam_rows.append(seq)
                continue
            group = self.groups[seq.request_id]
            if not group.forked:                                     # n > 1: n draws from the prompt's end
                group.forked = True
                sample_rows += [SampleRow(seq, j, fork=True) for j in range(1, seq.params.n)]
            sample_rows.append(SampleRow(seq, seq.index))
        beam_k = 0
        if beam_rows:
            beam_k = min(self.vocab_size, max(2 * self.groups[s.request_id].beam.params.beam_width for s in beam_rows))
        step = build_step_inputs(out, self.block_manager, sample_rows, beam_rows, beam_k)
        result = self.runner.execute(step)
        for i, row in enumerate(sample_rows):
            if not row.fork:
                seq = row.seq
                seq.last_token_inflight = self.outputs.is_last_token(seq)
                seq.num_inflight += 1
                seq.inflight_row = i
        self.scheduler.update(out)
        return _Plan(step.num_tokens, sample_rows, beam_rows), result

    def _process(self, plan, result):
        """The tokens of a launched step: append, stop, fork, beam search.
        Returns (RequestOutputs, number of tokens generated); with a deltas_only output processor the running
        streamed requests' progress is one StepDeltas, last."""
        tokens, logprobs, beams = result.wait()
        if plan.sample_rows:
            tokens, logprobs = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()   # Python numbers, once
        t = now()
        touched = {}
        failed = {}                     # request_id -> (group, exception): finished alone, with an error
        rows = [] if self.outputs.deltas_only else None     # the step's StepDeltas rows
        generated = 0
        for i, row in enumerate(plan.sample_rows):
            seq = row.seq
            group = self.groups.get(seq.request_id)
            if row.fork:
                if group is None or seq.is_finished or seq.request_id in failed:
                    continue
                target = self.fork(seq, row.index)
                target.num_pending_forks = 0
                self.outputs.init_sequence(target, group.stream)
            else:
                seq.num_inflight -= 1
                seq.last_token_inflight = False
                seq.num_pending_forks = 0
                if seq.is_finished or group is None or seq.request_id in failed:
                    continue            # finished one step earlier (async), aborted, or failed in this step
                target = seq
            generated += 1
            token = tokens[i]
            try:
                if not 0 <= token < self.vocab_size:
                    raise RuntimeError(f"the sampler returned token id {token} for this request's row, outside "
                                       f"the vocabulary [0, {self.vocab_size})")
                reason = self.outputs.append(target, token, logprobs[i], t)
            except Exception as e:      # noqa: BLE001 (this request's failure alone: the others go on)
                failed[group.request_id] = (group, e)
                continue
            if reason is not None:
                self.scheduler.finish(target, reason)
            elif not group.stream:
                continue                # nothing to report until it finishes
            elif rows is not None and len(group.seqs) == 1 and group.forked and group.beam is None:
                rows.append(self.outputs.delta(target))     # a running completion alone: its row, at once
                continue
            touched[group.request_id] = group
        for j, seq in enumerate(plan.beam_rows):
            group = self.groups.get(seq.request_id)
            if group is None or seq.is_finished or seq.request_id in failed:
                continue
            seq.beam_candidates = (beams[0][j], beams[1][j])
            if group.beam.ready:
                try:
                    group.beam.advance(self)
                except Exception as e:  # noqa: BLE001
                    failed[group.request_id] = (group, e)
                    continue
                generated += len(group.beam.beams)
                touched[group.request_id] = group
        results = []
        for group in touched.values():
            if group.request_id in failed:
                continue
            try:
                if group.is_finished:
                    results.append(self._final_output(group, t))
                    del self.groups[group.request_id]
                elif rows is not None and group.stream:
                    rows += self.outputs.deltas(group)
                elif group.stream:
                    results.append(self.outputs.request_output(group, t))
            except Exception as e:      # noqa: BLE001 (detokenizing one request's text failed)
                failed[group.request_id] = (group, e)
        for group, exc in failed.values():
            results.append(self.fail_request(group, exc))
        if rows:
            results.append(StepDeltas(rows))
        return results, generated

    def fail_request(self, group, exc):
        """Finish one request with an error (its completions' finish_reason "error", RequestOutput.error the
        message) and free its blocks; the rest of the batch is untouched. Returns its final RequestOutput."""
        logger.error("request %r failed in the engine: %r", group.request_id, exc)
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self.free_sequence(seq, "error")
        seqs = sorted(group.seqs, key=lambda s: s.index)
        outputs = [CompletionOutput(s.index, "", list(s.output_token_ids), "error") for s in seqs]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished=True,
                             error=f"the request failed in the engine: {exc!r}")

    def _final_output(self, group, t):
        if group.beam is not None:
            out = self.outputs.request_output(group, t)
            out.outputs = group.beam.completions(self.detokenize)
        else:
            out = self.outputs.request_output(group, t)
        self.stats.record_request(out.metrics)
        return out

    def detokenize(self, token_ids):
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- metrics --------------------------------------------------------------------------------
    def _fragmentation(self):
        bm = self.block_manager
        lens = {s.seq_id: min(s.num_tokens, len(bm.sequence_blocks[s.seq_id]) * bm.block_size)
                for s in self.scheduler.running}
        return bm.internal_fragmentation(lens)

    def metrics(self):
        """Engine metrics as a flat dict (see docs/engine.md)."""
        bm = self.block_manager
        frag = self._fragmentation()
        return {
            "num_blocks": bm.total_blocks,
            "block_size": bm.block_size,
            "num_free_blocks": bm.num_free_blocks,
            "kv_cache_usage": bm.utilization,
            "peak_kv_usage": bm.peak_num_used_blocks / bm.total_blocks if bm.total_blocks else 0.0,
            "kv_fragmentation": frag.ratio,
            "mean_kv_fragmentation": self.stats.frag_sum / self.stats.frag_n if self.stats.frag_n else 0.0,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_queried_tokens": bm.num_query_tokens,
            "prefix_cache_hit_tokens": bm.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **self.stats.as_dict(),
        }


