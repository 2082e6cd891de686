"""The engine at TP=2 with the all-reduce fused with the residual add + RMSNorm, on against off.

    python3 scripts/bench_tp_fused_norm.py --device cuda --out OUT              # 2 GPUs: 0.5B and 7B configs
    python3 scripts/bench_tp_fused_norm.py --device cuda --configs 7b --eager --out OUT
    python3 scripts/bench_tp_fused_norm.py --device cpu --out OUT               # 2 CPU ranks over gloo: a smoke run

Each config (random weights of scripts/benchlib.py's Qwen2 configs, fp16 on CUDA; on the CPU a tiny config
in float32) runs in one engine per mode, LLM(tensor_parallel_size=2, fused_allreduce=mode) (every rank's model
build reads it; pagedattn/distributed/allreduce_norm.py):

    off   the all-reduce after o_proj and down_proj in every step (what auto does below its threshold)
    on    the fused path (reduce-scatter, add + norm on this rank's rows, all-gather) in every eager step;
          a decode step that replays a CUDA graph keeps the all-reduce (its capture never fuses), so with
          graphs the decode numbers of on and off measure the same program; --eager adds both modes with
          enforce_eager, where decode steps fuse too

Checked first: the greedy ids of a few prompts, on against off (at P = 2 both paths add the same two terms,
so they should agree; a near-tie may still flip in fp16 after the first differing step, reported not
asserted). Then timed, prefix caching off, prompts of fresh random ids:

    prefill_ms[T]   one request of T prompt tokens and max_tokens=1: the wall time of the call, median of
                    --repeats (one prefill step of T rows + sampling one token + the engine's host work)
    decode_tok_s[B] B requests of --decode-prompt tokens: B (N - 1) / (t(N new tokens) - t(1 new token)),
                    N = --decode-tokens, medians of --repeats

Results: <out>/bench_tp_fused_norm.{json,md}, one row per config and mode, and on / off ratios.
"""
import gc
import os
import random
import statistics
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` and `pagedattn` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scripts import benchlib  # noqa: E402

TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2)
CUDA_DEFAULTS = dict(configs=("0.5b", "7b"), prefill_tokens=(512, 2048, 8192), decode_batch=(1, 32),
                     decode_prompt=128, decode_tokens=64, repeats=5)
CPU_DEFAULTS = dict(configs=("tiny",), prefill_tokens=(16, 64), decode_batch=(1, 4), decode_prompt=16,
                    decode_tokens=8, repeats=2)
CHECK_PROMPTS, CHECK_TOKENS = 4, 16


def _prompts(n, length, vocab, rng):
    return [[rng.randrange(min(10000, vocab)) for _ in range(length)] for _ in range(n)]


def _seconds(llm, prompts, max_tokens):
    from pagedattn import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    watch = benchlib.Stopwatch()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = watch.elapsed()
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return seconds, [o.outputs[0].token_ids for o in outs]


def run_mode(ckpt, device, mode, eager, args, vocab):
    """One engine at TP=2 with fused_allreduce=mode: the check ids, prefill_ms and decode_tok_s."""
    from pagedattn import LLM

    rng = random.Random(0)
    longest = max(max(args["prefill_tokens"]), args["decode_prompt"] + args["decode_tokens"])
    batch = max(args["decode_batch"])
    engine_kw = dict(device=device, tensor_parallel_size=2, fused_allreduce=mode, enforce_eager=eager,
                     enable_prefix_caching=False,
                     max_model_len=longest + 16, max_num_seqs=max(batch, CHECK_PROMPTS),
                     max_num_batched_tokens=max(max(args["prefill_tokens"]), args["decode_prompt"] * batch))
    if device == "cuda":
        engine_kw["dtype"] = "float16"
    with LLM(ckpt, **engine_kw) as llm:
        fused = llm.engine.runner.model.fused_allreduce         # rank 0's (every rank's alike)
        min_tokens = fused.min_tokens if fused is not None else None
        del fused                                                        # nothing outlives the engine
        _, check = _seconds(llm, _prompts(CHECK_PROMPTS, 24, vocab, random.Random(7)), CHECK_TOKENS)
        for T in args["prefill_tokens"]:                              # warm-up: kernels, graphs, cuBLAS
            _seconds(llm, _prompts(1, T, vocab, rng), 1)
        prefill = {T: 1e3 * statistics.median(_seconds(llm, _prompts(1, T, vocab, rng), 1)[0]
                                              for _ in range(args["repeats"]))
                   for T in args["prefill_tokens"]}
        decode = {}
        for B in args["decode_batch"]:
            n = args["decode_tokens"]
            t1 = statistics.median(_seconds(llm, _prompts(B, args["decode_prompt"], vocab, rng), 1)[0]
                                   for _ in range(args["repeats"]))
            tn = statistics.median(_seconds(llm, _prompts(B, args["decode_prompt"], vocab, rng), n)[0]
                                   for _ in range(args["repeats"]))
            decode[B] = B * (n - 1) / max(tn - t1, 1e-9)
    return dict(mode=mode, graphs=not eager and device == "cuda", min_tokens=min_tokens,
                prefill_ms=prefill, decode_tok_s=decode, check_ids=check)


def _release(device):
    """Give a closed engine's memory back to the driver before the next one sizes its KV pool."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _markdown(rows, ratios, meta):
    lines = [f"TP=2, {meta['device']}, dtype {meta['dtype']}; prefill: one request of T tokens, max_tokens=1 (ms, "
             f"median of {meta['repeats']}); decode: B requests of {meta['decode_prompt']} prompt tokens, "
             f"{meta['decode_tokens']} new tokens (tok/s). on = fused_allreduce='on' (every eager step "
             "fused; decode graphs keep the all-reduce), off = the all-reduce always.", ""]
    prefill_cols = [f"prefill {T} ms" for T in meta["prefill_tokens"]]
    decode_cols = [f"decode B={B} tok/s" for B in meta["decode_batch"]]
    table = [dict(config=r["config"], mode=r["mode"], graphs=r["graphs"],
                  **{c: r["prefill_ms"][T] for c, T in zip(prefill_cols, meta["prefill_tokens"])},
                  **{c: r["decode_tok_s"][B] for c, B in zip(decode_cols, meta["decode_batch"])}) for r in rows]
    lines.append(benchlib.markdown_table(table, ["config", "mode", "graphs", *prefill_cols, *decode_cols],
                                         floatfmt="{:.4g}"))
    lines += ["", "on / off (prefill: time ratio, < 1 is faster; decode: rate ratio, > 1 is faster), and the "
              "check (greedy ids equal):", ""]
    lines.append(benchlib.markdown_table(ratios, floatfmt="{:.3f}"))
    return "\n".join(lines) + "\n"


def main(device=None, configs=None, model=None, prefill_tokens=None, decode_batch=None, decode_prompt=None,
         decode_tokens=None, repeats=None, eager=False, out=None):
    """Returns {"rows": one per config and mode, "ratios": one per config (and graphs / eager), "meta": ...}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    args = dict(prefill_tokens=tuple(prefill_tokens or defaults["prefill_tokens"]),
                decode_batch=tuple(decode_batch or defaults["decode_batch"]),
                decode_prompt=decode_prompt or defaults["decode_prompt"],
                decode_tokens=decode_tokens or defaults["decode_tokens"], repeats=repeats or defaults["repeats"])
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"TP=2 on CUDA needs 2 GPUs, {torch.cuda.device_count()} visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")       # NVLink multicast off, as on every run here
    from pagedattn.models.loader import read_config

    targets = [("model", model)] if model else [
        (c, benchlib.random_checkpoint(TINY if c == "tiny" else c, dtype=torch.float16 if device == "cuda"
                                       else torch.float32)) for c in (configs or defaults["configs"])]
    rows, ratios = [], []
    for name, ckpt in targets:
        vocab = read_config(ckpt).vocab_size
        for eager in ((False, True) if eager and device == "cuda" else (device != "cuda",)):
            pair = {}
            for mode in ("off", "on"):
                r = dict(config=name, **run_mode(ckpt, device, mode, eager, args, vocab))
                print(f"{name} {mode} {'eager' if eager else 'graphs'}: prefill ms {r['prefill_ms']}, "
                      f"decode tok/s { {b: round(v, 1) for b, v in r['decode_tok_s'].items()} }", flush=True)
                rows.append(r)
                pair[mode] = r
                _release(device)
            on, off = pair["on"], pair["off"]
            ratios.append(dict(config=name, graphs=on["graphs"],
                               **{f"prefill {T}": on["prefill_ms"][T] / off["prefill_ms"][T]
                                  for T in args["prefill_tokens"]},
                               **{f"decode B={B}": on["decode_tok_s"][B] / off["decode_tok_s"][B]
                                  for B in args["decode_batch"]},
                               greedy_equal=f"{sum(a == b for a, b in zip(on['check_ids'], off['check_ids']))}"
                                            f"/{len(off['check_ids'])}"))
    meta = dict(device=device, dtype="float16" if device == "cuda" else "float32", models=dict(targets), **args)
    md = _markdown(rows, ratios, meta)
    print(benchlib.env_line() + "\n\n" + md)
    if out:
        benchlib.save(out, "bench_tp_fused_norm", rows, {**meta, "ratios": ratios}, md)
    return dict(rows=rows, ratios=ratios, meta=meta)


if __name__ == "__main__":
    import argparse

    def ints(s):
        return [int(x) for x in s.split(",")]

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--configs", default=None,
                    help="comma-separated: 0.5b, 7b, tiny (default: 0.5b,7b on cuda, tiny on cpu)")
    ap.add_argument("--model", default=None, help="a Qwen2 checkpoint directory instead of --configs")
    ap.add_argument("--prefill-tokens", type=ints, default=None)
    ap.add_argument("--decode-batch", type=ints, default=None)
    ap.add_argument("--decode-prompt", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--eager", action="store_true", help="also both modes with enforce_eager (CUDA)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    main(a.device, a.configs.split(",") if a.configs else None, a.model, a.prefill_tokens, a.decode_batch,
         a.decode_prompt, a.decode_tokens, a.repeats, a.eager, a.out)
