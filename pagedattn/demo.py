"""Demo: coding questions on the bundled model, answers streamed as they are produced, paging at work.

    python -m pagedattn                                   # two rounds, greedy, up to 192 tokens per answer
    python -m pagedattn --prompt "Write a haiku about caches." --max-tokens 64 --temperature 0.7
    python -m pagedattn --model path/to/qwen2_dir --device cuda

Round 1: four questions batched together (one engine, continuous batching). Their answers are shown
one at a time: the first streams token by token while the others keep decoding underneath; when its
turn comes, an answer prints what it has buffered so far, then continues live. All four prompts are
prefilled in the same step, so none can reuse another's KV blocks yet.
Round 2: two follow-ups with the same system prompt. Their prompts' leading blocks (the system prompt,
computed in round 1) come from the prefix cache; one asks for n=3 sampled completions, which share
the prompt's blocks instead of holding three copies.
Then a table per request and the numbers: tokens/s (model loading and the warm-up excluded),
prefix-cache hit rate per round, KV blocks saved by sharing.
"""
import argparse
import shutil
import sys
import time

SYSTEM_PROMPT = (
    "You are a concise senior Python engineer answering questions from colleagues. "
    "Reply with one short code block when code helps, followed by at most two sentences of explanation. "
    "Use clear names, type hints and docstrings, prefer the standard library, and never invent APIs. "
    "If a question is ambiguous, state the assumption you made in one short sentence."
)
DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a hash map is in two sentences.",
    "Write a SQL query that returns the 5 most recent orders.",
]
FOLLOW_UP = "Write a Python function that merges two sorted lists into one sorted list."
NAMING = ("Suggest a name for a Python function that removes duplicate items from a list while keeping "
          "their order. Answer with the name only.")
NAMING_N, NAMING_TEMPERATURE, NAMING_MAX_TOKENS = 3, 0.8, 24
WARMUP_PROMPT = "Hello"        # no chat template: shares no block with the questions (round 1 stays cold)


class StreamPrinter:
    """Shows the completions of a batch one at a time, in order, as their tokens arrive.

    items: (label, request index, completion index) in display order. `update(out)` takes a
    RequestOutput of LLM.stream (cumulative text per completion); the current item's new text is
    printed at once, the others' is kept until their turn. live: append a status after the cursor
    (tokens so far, tok/s, answers done), redrawn at every token; for terminals only (ANSI codes).
    """

    def __init__(self, items, write, live):
        self.items, self.write, self.live = items, write, live
        self.text = {(r, c): "" for _, r, c in items}
        self.done = {}                              # (request, completion) -> finish reason
        self.pos, self.printed, self.col, self.status_shown = 0, 0, 0, False
        self.tokens, self.t0 = 0, time.perf_counter()
        if items:
            self._header()

    def update(self, out):
        for c in out.outputs:
            key = (out.prompt_index, c.index)
            if key not in self.text:
                continue
            self.tokens += len(c.delta_token_ids)
            self.text[key] = c.text
            if c.finish_reason is not None:
                self.done[key] = c.finish_reason
        self._advance()

    def _emit(self, s):
        if self.status_shown:
            self.write("\033[K")                    # erase the status drawn after the cursor
            self.status_shown = False
        self.write(s)
        self.col = len(s) - s.rfind("\n") - 1 if "\n" in s else self.col + len(s)

    def _header(self):
        label, r, c = self.items[self.pos]
        self._emit(f"\n--- [{self.pos + 1}/{len(self.items)}] {label}\n")
        self.printed = 0

    def _advance(self):
        while self.pos < len(self.items):
            _, r, c = self.items[self.pos]
            text = self.text[(r, c)]
            if len(text) > self.printed:
                self._emit(text[self.printed:])
                self.printed = len(text)
            if (r, c) not in self.done:
                break
            self._emit(f"\n    [{self.done[(r, c)]}]\n")
            self.pos += 1
            if self.pos < len(self.items):
                self._header()
        if self.live and self.pos < len(self.items):
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            status = f"  < {self.tokens} tokens, {rate:.1f} tok/s, {len(self.done)}/{len(self.items)} answers done >"
            if self.col + len(status) < shutil.get_terminal_size().columns:
                self.write(f"\033[2m{status}\033[0m\033[{len(status)}D")   # dim, then the cursor back
                self.status_shown = True


def kv_sharing(engine, request_id):
    """(running sequences, their block-table entries, distinct physical blocks behind them) of one request."""
    group, bm = engine.groups.get(request_id), engine.block_manager
    if group is None:
        return 0, 0, 0
    tables = [bm.block_table(s.seq_id) for s in group.seqs if s.seq_id in bm.sequence_blocks]
    return len(tables), sum(len(t) for t in tables), len({b for t in tables for b in t})


def run_round(llm, title, requests, write, live):
    """requests: (label, chat prompt, SamplingParams). Streams them as one batch; returns (outputs in
    request order, seconds, (block-table entries, physical blocks) of the n > 1 request, seen at the last
    step where all its completions were running: after each one's copy-on-write of the prompt's last,
    partly filled block, so only the full prompt blocks are still shared)."""
    write(f"\n=== {title}\n")
    items = [(label if p.n == 1 else f"{label}  (completion {c + 1} of {p.n})", r, c)
             for r, (label, _, p) in enumerate(requests) for c in range(p.n)]
    printer = StreamPrinter(items, write, live)
    final, sharing = [None] * len(requests), (0, 0)
    t0 = time.perf_counter()
    for out in llm.stream([chat for _, chat, _ in requests], [p for _, _, p in requests]):
        printer.update(out)
        n = requests[out.prompt_index][2].n
        if n > 1 and not out.finished:
            running, entries, physical = kv_sharing(llm.engine, out.request_id)
            if running == n and len(out.outputs[0].token_ids) > 1:
                sharing = (entries, physical)
        if out.finished:
            final[out.prompt_index] = out
    return final, time.perf_counter() - t0, sharing


def cache_line(outs):
    hit = sum(o.num_cached_tokens for o in outs)
    total = sum(len(o.prompt_token_ids) for o in outs)
    return hit, total, f"{hit} of {total} prompt tokens ({100 * hit / max(total, 1):.1f}%) from the prefix cache"


def table(rows):
    """rows: dicts with the same keys, printed as aligned columns."""
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main(prompts=None, max_tokens=192, temperature=0.0, model=None, device="auto", second_round=True,
         live=None, out=None):
    """Run the demo; returns the finished RequestOutputs of every round, in order.

    prompts: round-1 questions (default DEFAULT_PROMPTS). max_tokens / temperature: for the questions.
    second_round: the follow-up round (prefix-cache hits, n=3 shared completions). live: per-token
    status after the cursor (default: when `out` is a terminal). out: a text stream (default stdout).
    """
    from pagedattn import LLM, SamplingParams

    out = out or sys.stdout
    live = out.isatty() if live is None else live

    def write(s):
        out.write(s)
        out.flush()

    t0 = time.perf_counter()
    llm = LLM(model, device=device, max_model_len=2048, max_num_seqs=16)
    engine = llm.engine
    load_s = time.perf_counter() - t0
    cache = engine.kv_cache
    backend = engine.model.attn_backend
    m = llm.metrics()
    weights = f"weights: {m['model_weight_bytes'] / 2**20:.0f} MiB" + (
        f" (the GGUF file's quantized blocks, {m['activations']} activations)" if m["weights"] == "quantized"
        else " (float32)")
    write(f"model: {engine.model_path} on {engine.config.device} "
          f"({str(cache.dtype).replace('torch.', '')}), {weights}, attention backend {getattr(backend, 'name', backend)}, "
          f"KV pool {engine.num_blocks} blocks x {cache.block_size} tokens "
          f"({engine.num_blocks * cache.bytes_per_block / 2**20:.0f} MiB); loaded in {load_s:.1f} s\n")

    tok = llm.get_tokenizer()
    t0 = time.perf_counter()
    if engine.config.device_type == "cpu":     # CUDA compiled its kernels in LLM() (a line per phase)
        write("warm-up: the first calls compile the CPU kernels, once per machine (about 1.5 min on 2 cores; "
              "later runs load them from disk in seconds) ...\n")
    llm.generate([tok.encode(WARMUP_PROMPT)], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    write(f"warm-up (first calls compile or load the kernels): {time.perf_counter() - t0:.1f} s, not counted below\n")

    def chat(question):
        return tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)

    answer = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature > 0 else None)
    rounds = [("Round 1: the questions, batched together", [(f"Q: {q}", chat(q), answer)
                                                            for q in (prompts or DEFAULT_PROMPTS)])]
    if second_round:
        naming = SamplingParams(n=NAMING_N, temperature=NAMING_TEMPERATURE, max_tokens=min(NAMING_MAX_TOKENS, max_tokens),
                                seed=0)
        rounds.append(("Round 2: follow-ups with the same system prompt (its KV blocks are cached from round 1)",
                       [(f"Q: {FOLLOW_UP}", chat(FOLLOW_UP), answer), (f"Q: {NAMING}", chat(NAMING), naming)]))

    results, rows, summary = [], [], []
    total_tokens, total_s = 0, 0.0
    for k, (title, requests) in enumerate(rounds, start=1):
        outs, seconds, (entries, physical) = run_round(llm, title, requests, write, live)
        results.append(outs)
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        total_tokens, total_s = total_tokens + generated, total_s + seconds
        hit, _, line = cache_line(outs)
        why = " (all its prompts were prefilled in one step, so none could reuse another's blocks yet)" \
            if k == 1 and hit == 0 else ""
        summary.append(f"round {k}: {generated} tokens in {seconds:.1f} s = {generated / seconds:.1f} tok/s; "
                       f"{line}{why}")
        if entries:
            saved = entries - physical
            summary.append(f"round {k}: n={NAMING_N} completions of one prompt hold {entries} block-table entries "
                           f"in {physical} physical blocks: {saved} blocks "
                           f"({saved * cache.bytes_per_block / 2**20:.1f} MiB) saved against a copy of the prompt "
                           f"per completion")
        for (label, _, p), o in zip(requests, outs):
            rows.append({"round": k, "request": label[3:43] + ("..." if len(label) > 43 else ""),
                         "prompt tok": len(o.prompt_token_ids), "cached tok": o.num_cached_tokens,
                         "generated": sum(len(c.token_ids) for c in o.outputs),
                         "finish": ",".join(c.finish_reason for c in o.outputs),
                         "TTFT s": f"{o.metrics.ttft:.2f}" if o.metrics and o.metrics.ttft is not None else "-"})

    m = llm.metrics()
    write("\n" + "=" * 100 + "\n" + table(rows) + "\n\n")
    for line in summary:
        write(line + "\n")
    write(f"all rounds: {total_tokens} generated tokens in {total_s:.1f} s -> {total_tokens / total_s:.1f} tok/s "
          f"(model loading and warm-up not counted); prefix-cache hit rate overall "
          f"{100 * m['prefix_cache_hit_rate']:.1f}%; KV blocks used at peak: "
          f"{round(m['peak_kv_usage'] * m['num_blocks'])} of {m['num_blocks']}; preemptions: {m['num_preemptions']}\n")
    return results


def cli(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pagedattn", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", action="append", help="a round-1 question (repeatable); default: four coding questions")
    ap.add_argument("--max-tokens", type=int, default=192, help="per answer (stops earlier at end of turn)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="HF Qwen2 directory (default: the bundled model)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--no-second-round", action="store_true", help="skip the follow-up round")
    ap.add_argument("--no-progress", action="store_true", help="no live status after the cursor")
    a = ap.parse_args(argv)
    main(a.prompt, a.max_tokens, a.temperature, a.model, a.device, not a.no_second_round,
         live=False if a.no_progress else None)
