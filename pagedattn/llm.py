"""The offline API (vLLM's shape): LLM(...).generate(prompts, SamplingParams(...)).

    from pagedattn import LLM, SamplingParams
    llm = LLM()                                          # the bundled Qwen2.5-Coder-0.5B-Instruct
    outs = llm.generate(["def fib(n):", [151644, 872]], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

    for out in llm.stream(["def fib(n):"], SamplingParams(max_tokens=64)):     # tokens as they come
        print(out.outputs[0].delta_text, end="", flush=True)

Strings are tokenized as they are (no chat template: apply `llm.get_tokenizer().apply_chat_template`
yourself, as the demo does).
"""
import contextlib
import itertools
import logging
import sys
import time
import weakref

from tqdm.auto import tqdm

from pagedattn.config import EngineConfig
from pagedattn.engine.beam_search import beam_search_output
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import BeamSearchParams, SamplingParams

startup_log = logging.getLogger("pagedattn.startup")


@contextlib.contextmanager
def startup_progress(show):
    """While an LLM is built: one stderr line per start-up phase ("pagedattn: loading the model ...") when
    `show` (on CUDA, or on a terminal) and the application has not configured logging itself."""
    if not show or startup_log.handlers or logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pagedattn: %(message)s"))
    level = startup_log.level
    startup_log.addHandler(handler)
    startup_log.setLevel(logging.INFO)
    startup_log.propagate = False
    try:
        yield
    finally:
        startup_log.removeHandler(handler)
        startup_log.setLevel(level)
        startup_log.propagate = True


class LLM:
    """A Qwen2 model on the paged runtime.

    model: HF Qwen2 checkpoint directory, None = the bundled model. The other arguments are
    EngineConfig's (device, dtype, block_size, num_blocks, max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, attn_backend, enforce_eager, async_scheduling, seed, ...).

    weights: "auto" (default), "quantized" or "float32". "quantized" runs the bundled model's (or a
    directory's one .gguf file's) quantized blocks on the CPU: ~0.46 GB of weights instead of the
    float32 copy's 2.4 GB, and faster decoding (docs/cpu.md); "auto" takes it on the CPU (float32,
    one rank) where there is a GGUF file, "float32" elsewhere. "quantized" on a GPU, in
    float16/bfloat16, with tensor parallelism or for a checkpoint without a GGUF file raises
    InvalidRequestError.
    activations: "auto" (default), "int8" or "float32" on the quantized weights: "int8" rounds each
    32-value block of a matrix's input to int8, as llama.cpp does, for integer dot products — ~1.3x faster
    decoding, not exactly the same function (outputs within ~1e-2 of their scale) — and runs a prompt's
    products in bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX: ~1.7x faster prompts);
    "float32" computes the dequantized matrices' products. "auto" takes "int8" where the CPU has AVX2,
    "float32" elsewhere.
    "int8" without quantized weights raises InvalidRequestError.
    batch_invariant: True makes each request's token ids and logprobs the same bits whatever else is in
    the batch, the token budget, preemption or prefix-cache hits (seeded sampling included): on the CPU in
    float32, on a GPU in float16 / bfloat16, one rank; docs/batch_invariance.md says what it guarantees
    and costs.

    tensor_parallel_size: P > 1 shards the model over P ranks (see docs/tensor_parallel.md): this process
    is rank 0 and starts P - 1 worker processes (spawn; NCCL on cuda:0..P-1, gloo on CPU). They stop on
    close(), at the end of a `with LLM(...)` block, at interpreter exit, and after a failed step. Scripts
    that use it need the `if __name__ == "__main__":` guard that spawn requires. Under torchrun (P =
    WORLD_SIZE ranks, on one host or several) no process is started: rank 0's LLM(...) returns and drives
    the others, and on every other rank LLM(...) runs the worker loop and exits the process when rank 0
    closes (with an error if rank 0 or a peer fails), so one script runs on every rank.
    """

    def __init__(self, model=None, device="auto", dtype="auto", tensor_parallel_size=1, **kwargs):
        self._close = None
        config = EngineConfig(model=model, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                              **kwargs)
        t = time.perf_counter()
        with startup_progress(config.device_type == "cuda" or sys.stderr.isatty()):
            self.engine = LLMEngine(config)
            times = self.engine.startup_times
            startup_log.info(f"ready in {time.perf_counter() - t:.1f} s ("
                             + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in times.items()
                                         if isinstance(v, float)) + ")")
        self._close = weakref.finalize(self, self.engine.shutdown)   # also runs at interpreter exit
        self._request_ids = itertools.count()

    def close(self):
        """Give back what the engine holds — weights, KV pool, graphs, the kernels' cached views and scratch
        (docs/memory.md) — and stop the tensor-parallel workers; idempotent. The end of a `with LLM(...)`
        block and the LLM's collection (`del llm`) do the same; a closed LLM raises on use."""
        if self._close is not None:
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_tokenizer(self):
        """The checkpoint's HF tokenizer (with its chat template), or None for a bare checkpoint. (The engine
        itself encodes and decodes through tokenizer.json directly: pagedattn.engine.tokenizer.)"""
        tok = self.engine.tokenizer
        return getattr(tok, "hf", tok)

    def metrics(self):
        """Engine metrics: KV usage, fragmentation, prefix-cache hit rate, preemptions, throughput..., and
        the model's: `weights` ("quantized" / "float32"), `activations` (the quantized path's: "int8" /
        "float32") and `model_weight_bytes` (rank 0's weights; the GGUF blocks as in the file on the
        quantized path)."""
        from pagedattn.engine.metrics import model_weight_bytes

        return {**self.engine.metrics(), "weights": self.engine.config.weights,
                "activations": self.engine.config.activations,
                "model_weight_bytes": model_weight_bytes(self.engine.model)}

    @staticmethod
    def _as_prompt_list(prompts):
        if isinstance(prompts, str):
            return [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a str, a list of token ids, or a list of those, "
                                      f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]                 # one prompt given as token ids
        return prompts

    def _add(self, prompts, sampling_params, stream):
        """Validate every request first (the first bad one raises InvalidRequestError naming its index and
        the field), then queue them all. Returns their request ids in the prompts' order."""
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise InvalidRequestError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts: "
                                      "give one, or one per prompt")
        token_ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                token_ids.append(self.engine.validate_request(prompt, p))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"request {i}: {e}") from e
        ids = []
        for prompt, p, toks in zip(prompts, params, token_ids):
            rid = f"gen-{next(self._request_ids)}"
            self.engine.add_request(rid, prompt, p, prompt_token_ids=toks, stream=stream)
            ids.append(rid)
        return ids

    def _run(self, ids, use_tqdm, desc="Generating"):
        """Step until every request in ids finished; yields each RequestOutput the steps return."""
        engine, pending, ids = self.engine, set(ids), set(ids)
        bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.request_id not in ids:
                        engine.defer(out)            # another caller's request: theirs at the next step
                        continue
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        bar.update(1)
                    yield out
                m = engine.stats
                if m.step_time:
                    bar.set_postfix_str(f"{m.num_generated_tokens / m.step_time:.1f} tok/s, "
                                        f"KV {100 * engine.block_manager.utilization:.0f}%", refresh=False)
        finally:
            for rid in pending:              # interrupted: leave the engine clean for the next call
                engine.abort_request(rid)
            bar.close()

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        """Complete every prompt; returns RequestOutputs in the prompts' order.

        prompts: a str, a list of token ids, or a list of those. sampling_params: one SamplingParams
        for all, or one per prompt (default: SamplingParams()). A bad request raises InvalidRequestError
        before any is queued; a request that fails inside the engine (its row alone) comes back in its
        place with `error` set and finish_reason "error", the others complete as they would alone.
        """
        ids = self._add(prompts, sampling_params, stream=False)
        results = {out.request_id: out for out in self._run(ids, use_tqdm) if out.finished}
        return [results[rid] for rid in ids]

    def stream(self, prompts, sampling_params=None):
        """Like generate, but yields each request's progress as it is made: RequestOutputs whose
        completions carry delta_text / delta_token_ids (what the step added), the last one with
        finished=True; `out.prompt_index` is the prompt's position in `prompts`."""
        ids = self._add(prompts, sampling_params, stream=True)
        index = {rid: i for i, rid in enumerate(ids)}
        for out in self._run(ids, use_tqdm=False):
            if out.request_id in index:
                out.prompt_index = index[out.request_id]
                yield out

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm=True):
        """Beam search over each prompt; returns one BeamSearchOutput per prompt (best beam first).
        See pagedattn.engine.beam_search."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        engine = self.engine
        prompts = self._as_prompt_list(prompts)
        prompt_ids = []
        for i, p in enumerate(prompts):
            try:
                prompt_ids.append(engine.validate_request(p, params))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"request {i}: {e}") from e
        results, order = [None] * len(prompts), list(range(len(prompts)))
        bs, width = engine.config.block_size, params.beam_width
        while order:                                    # groups of prompts whose worst case fits the pool
            group, used = [], 0
            for i in order:
                need = width * -(-(len(prompt_ids[i]) + params.max_tokens) // bs)
                if group and used + need > engine.num_blocks:
                    break
                group.append(i)
                used += need
            order = order[len(group):]
            rids = {}
            for i in group:
                rid = f"beam-{next(self._request_ids)}"
                rids[rid] = i
                engine.add_beam_request(rid, prompts[i], params, prompt_token_ids=prompt_ids[i])
            states = {rid: engine.groups[rid] for rid in rids}
            for out in self._run(list(rids), use_tqdm, desc="Beam search"):
                if out.finished and out.request_id in rids:
                    g = states[out.request_id]
                    i = rids[out.request_id]
                    results[i] = beam_search_output(prompts[i], prompt_ids[i], g.beam, engine.detokenize)
        return results
