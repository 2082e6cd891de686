"""The offline API (vLLM's shape): LLM(...).generate(prompts, SamplingParams(...)).

    from pagedattn import LLM, SamplingParams
    llm = LLM()                                          # the bundled Qwen2.5-Coder-0.5B-Instruct
    outs = llm.generate(["def fib(n):", [151644, 872]], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

Strings are tokenized as they are (no chat template: apply `llm.get_tokenizer().apply_chat_template`
yourself, as the demo does).
"""
import itertools
import os
import weakref

from tqdm.auto import tqdm

from pagedattn.engine.llm_engine import EngineConfig, LLMEngine
from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """A Qwen2 model on the paged runtime.

    model: HF Qwen2 checkpoint directory, None = the bundled model. The other arguments are
    EngineConfig's (device, dtype, block_size, num_blocks, max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, attn_backend, enforce_eager, ...).

    tensor_parallel_size: P > 1 shards the model over P ranks (see docs/tensor_parallel.md): this process
    is rank 0 and starts P - 1 worker processes (spawn; NCCL on cuda:0..P-1, gloo on CPU). They stop on
    close(), at the end of a `with LLM(...)` block, at interpreter exit, and after a failed step. Scripts
    that use it need the `if __name__ == "__main__":` guard that spawn requires.
    """

    def __init__(self, model=None, device="auto", dtype="auto", block_size=16, num_blocks=None,
                 max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=None,
                 enable_prefix_caching=True, attn_backend="auto", enforce_eager=False, tensor_parallel_size=1,
                 **kwargs):
        self._close = None
        if tensor_parallel_size != 1:
            enforce_eager = True             # the CUDA-graph decode path is single-rank
        config = EngineConfig(model=model, device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching, attn_backend=attn_backend,
                              enforce_eager=enforce_eager, **kwargs)
        if tensor_parallel_size == 1:
            self.engine = LLMEngine(config)
        else:
            self.engine = self._tensor_parallel_engine(config, tensor_parallel_size)
        self._request_ids = itertools.count()

    def _tensor_parallel_engine(self, config, tp):
        from pagedattn.distributed.parallel import check_tensor_parallel_size
        from pagedattn.distributed.worker import TensorParallelGroup
        from pagedattn.models.loader import read_config

        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if config.device not in ("cpu", "cuda", "cuda:0"):
            raise InvalidRequestError(f"tensor_parallel_size={tp} runs rank r on cuda:r (or all on cpu): "
                                      f"device must be 'auto', 'cpu', 'cuda' or 'cuda:0', got {config.device!r}")
        if config.model is None:
            from pagedattn.bundled import bundled_model_path
            config.model = bundled_model_path()
        path = os.fspath(config.model)
        check_tensor_parallel_size(read_config(path), tp)    # before any process starts
        group = TensorParallelGroup(tp, config, path)
        self._close = weakref.finalize(self, group.shutdown)  # also runs at interpreter exit
        try:
            return group.attach(LLMEngine(config))
        except BaseException:
            self._close()
            raise

    def close(self):
        """Stop the tensor-parallel workers (a no-op at tensor_parallel_size=1); idempotent."""
        if self._close is not None:
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_tokenizer(self):
        """The checkpoint's HF tokenizer (with its chat template), or None for a bare checkpoint."""
        return self.engine.tokenizer

    def metrics(self):
        """Engine metrics: KV usage, fragmentation, prefix-cache hit rate, preemptions, throughput..."""
        return self.engine.metrics()

    @staticmethod
    def _as_prompt_list(prompts):
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [prompts]                 # one prompt given as token ids
        return prompts

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        """Complete every prompt; returns RequestOutputs in the prompts' order.

        prompts: a str, a list of token ids, or a list of those. sampling_params: one SamplingParams
        for all, or one per prompt (default: SamplingParams()). Every request is validated before any
        starts; the first bad one raises InvalidRequestError naming its index and the field.
        """
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
        engine = self.engine
        ids = []
        for prompt, p, toks in zip(prompts, params, token_ids):
            rid = f"gen-{next(self._request_ids)}"
            engine.add_request(rid, prompt, p, prompt_token_ids=toks)
            ids.append(rid)
        results = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    results[out.request_id] = out
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        bar.update(1)
                m = engine.stats
                if m.step_time:
                    bar.set_postfix_str(f"{m.num_generated_tokens / m.step_time:.1f} tok/s, "
                                        f"KV {100 * engine.block_manager.utilization:.0f}%", refresh=False)
        except BaseException:
            for rid in pending:              # leave the engine clean for the next call
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm=True):
        """Beam search over each prompt; returns one BeamSearchOutput per prompt (best beam first).
        See pagedattn.engine.beam_search."""
        from pagedattn.engine.beam_search import beam_search
        return beam_search(self.engine, self._as_prompt_list(prompts), params, use_tqdm=use_tqdm)
