"""Demo: a few coding questions batched through the paged runtime on the bundled model.

    python -m pagedattn                                   # default questions, greedy, 48 tokens
    python -m pagedattn --prompt "Write a haiku about caches." --max-tokens 48 --temperature 0.7
    python -m pagedattn --model path/to/qwen2_dir --device cuda

Each question goes through the model's chat template (the shared system prompt makes the prefix
cache hit across requests); all of them run together in one continuously batched generate call.
"""
import argparse
import time

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that returns the 5 most recent orders.",
]


def main(prompts=None, max_tokens=48, temperature=0.0, model=None, device="auto", use_tqdm=True):
    from pagedattn import LLM, SamplingParams

    prompts = prompts or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    llm = LLM(model, device=device, max_model_len=2048, max_num_seqs=16)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    print(f"model: {engine.model_path} on {engine.device} ({str(engine.config.dtype).replace('torch.', '')}), "
          f"KV pool: {engine.num_blocks} blocks x {engine.config.block_size} tokens "
          f"({engine.num_blocks * engine.bytes_per_block / 2**20:.0f} MiB); loaded in {load_s:.1f} s")

    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature > 0 else None)
    t0 = time.perf_counter()
    outs = llm.generate(chats, params, use_tqdm=use_tqdm)
    gen_s = time.perf_counter() - t0

    for q, out in zip(prompts, outs):
        c = out.outputs[0]
        print("\n" + "=" * 80)
        print(f"Q: {q}")
        print(f"[{len(out.prompt_token_ids)} prompt tokens ({out.num_cached_tokens} from the prefix cache), "
              f"{len(c.token_ids)} generated, finish_reason={c.finish_reason}, "
              f"TTFT {out.metrics.ttft:.2f} s]")
        print(c.text.strip())

    m = llm.metrics()
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    print("\n" + "=" * 80)
    print(f"{len(outs)} request(s): {n_prompt} prompt tokens, {n_gen} generated tokens in {gen_s:.1f} s "
          f"-> {n_gen / gen_s:.1f} generated tok/s, {(n_prompt + n_gen) / gen_s:.1f} total tok/s")
    print(f"KV blocks used at peak: {round(m['peak_kv_usage'] * m['num_blocks'])} of {m['num_blocks']} "
          f"({100 * m['peak_kv_usage']:.1f}%); internal fragmentation (mean over steps): "
          f"{100 * m['mean_kv_fragmentation']:.1f}% of allocated slots")
    backend = engine.model.attn_backend
    print(f"attention backend: {getattr(backend, 'name', backend)}; "
          f"prefix-cache hit rate: {100 * m['prefix_cache_hit_rate']:.1f}% of prompt tokens; "
          f"preemptions: {m['num_preemptions']}; steps: {m['num_steps']}; "
          f"mean TTFT {m['mean_ttft_s']:.2f} s, mean inter-token latency {1000 * (m['mean_itl_s'] or 0):.0f} ms")
    return outs


def cli(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pagedattn", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", action="append", help="a question (repeatable); default: four coding questions")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="HF Qwen2 directory (default: the bundled model)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    main(a.prompt, a.max_tokens, a.temperature, a.model, a.device, not a.no_progress)
