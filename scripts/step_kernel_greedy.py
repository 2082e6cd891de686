"""The step family's exactness: greedy tokens of kernels_numba/step.py against HF transformers and the engine.

Five chat prompts (`pagedattn.bundled.CHECK_PROMPTS`, the real model's checks') are decoded together by
StepKernels.decode_step alone: a prompt goes in one token a step at its position, then each sequence's greedy
token, until EOS or --max-tokens. For each --versions:

  float32   against HF's generate(do_sample=False), float32 on the GPU: the same tokens up to EOS, or the first
            difference, with the top-two gap of the step kernel's logits there (a near-tie: within rounding);
  float16   against the engine's greedy (LLM(dtype="float16").generate, temperature 0), the same report.

    python scripts/step_kernel_greedy.py --model DIR --out OUT [--versions 3,5] [--max-tokens 128]

The issue's rule: float32 equal to HF; float16 equal to the engine or a first difference at a near-tie.
"""
import os
import sys

if __name__ == "__main__":          # run as a file: make `scripts.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pagedattn.bundled import CHECK_PROMPTS as PROMPTS  # noqa: E402


def step_greedy(kernels, prompts, eos_ids, max_new, block_size=16, on_gpu=False):
    """Greedy continuations of `prompts` (lists of token ids) by kernels.decode_step alone, all sequences in each
    step (each at its own position; a finished one leaves the step). Returns (new tokens [per prompt], the
    logits each new token was chosen from [per prompt, (n, vocab) float32 numpy])."""
    c = kernels.config
    S, L = len(prompts), c["num_layers"]
    per_seq = -(-(max(map(len, prompts)) + max_new) // block_size)
    shape = (L, S * per_seq, c["num_kv_heads"], block_size, c["head_dim"])
    tables = np.arange(S * per_seq, dtype=np.int32).reshape(S, per_seq)
    if on_gpu:
        import torch

        dtype = kernels.embed.dtype
        k_pool = torch.zeros(shape, dtype=dtype, device="cuda")
        v_pool = torch.zeros(shape, dtype=dtype, device="cuda")
        dev = lambda a: torch.as_tensor(a, device="cuda")                        # noqa: E731
        host = lambda t: t.cpu().numpy()                                         # noqa: E731
    else:
        k_pool, v_pool = np.zeros(shape, kernels.embed.dtype), np.zeros(shape, kernels.embed.dtype)
        dev, host = np.ascontiguousarray, np.asarray
    k_pools, v_pools = list(k_pool), list(v_pool)
    new = [[] for _ in prompts]
    chosen_from = [[] for _ in prompts]
    done = [False] * S
    t = 0
    while not all(done):
        live = [i for i in range(S) if not done[i]]
        tokens = [prompts[i][t] if t < len(prompts[i]) else new[i][-1] for i in live]
        logits, ids = kernels.decode_step(dev(np.array(tokens, np.int32)), dev(np.full(len(live), t, np.int32)),
                                          k_pools, v_pools, dev(np.ascontiguousarray(tables[live])))
        logits, ids = host(logits), host(ids)
        for row, i in enumerate(live):
            if t >= len(prompts[i]) - 1:                 # the last prompt token's step and after: a new token
                new[i].append(int(ids[row]))
                chosen_from[i].append(np.array(logits[row], np.float32))
                done[i] = new[i][-1] in eos_ids or len(new[i]) == max_new
        t += 1
    return new, [np.stack(x) for x in chosen_from]


def first_difference(ours, theirs, logits):
    """None when the two token lists are equal; else (index, our top-two gap there, whether their token is our
    second choice)."""
    for j in range(min(len(ours), len(theirs))):
        if ours[j] != theirs[j]:
            top2 = np.sort(logits[j])[-2:]
            return j, float(top2[1] - top2[0]), int(np.argsort(logits[j])[-2]) == theirs[j]
    if len(ours) != len(theirs):
        j = min(len(ours), len(theirs))
        return j, None, False
    return None


def compare_rows(version, dtype, peer, ours, theirs, logits):
    rows = []
    for p, (a, b, lg) in enumerate(zip(ours, theirs, logits)):
        diff = first_difference(a, b, lg)
        rows.append(dict(version=version, dtype=dtype, against=peer, prompt=p, tokens=len(a), peer_tokens=len(b),
                         identical=diff is None, first_difference=None if diff is None else diff[0],
                         top2_gap=None if diff is None else diff[1],
                         peer_is_our_second=None if diff is None else diff[2]))
    return rows


def main(out, model, versions, max_new):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kernels_numba.step import StepKernels
    from pagedattn import LLM, SamplingParams
    from reference.step import load_config
    from scripts import benchlib
    from scripts.bench_step_kernel import load

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [list(map(int, tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))) for p in PROMPTS]
    eos = {int(tok.eos_token_id)} | ({int(tok.pad_token_id)} if tok.pad_token_id is not None else set())
    config = load_config(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to("cuda").eval()
    hf_new = []
    for p in prompts:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                              device="cuda"), max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        hf_new.append(seq[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    llm = LLM(model, device="cuda", dtype="float16")
    engine_new = [list(o.outputs[0].token_ids) for o in
                  llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    rows = []
    for dtype, peer, theirs in ((torch.float32, "HF float32", hf_new), (torch.float16, "engine float16", engine_new)):
        weights = load(model, dtype)
        for version in versions:
            kernels = StepKernels(weights, config, on_gpu=True, version=version)
            ours, logits = step_greedy(kernels, prompts, eos, max_new, on_gpu=True)
            rows += compare_rows(version, str(dtype).replace("torch.", ""), peer, ours, theirs, logits)
            print(rows[-5:], flush=True)
        del weights
        torch.cuda.empty_cache()
    md = benchlib.markdown_table(rows)
    benchlib.save(out, "step_kernel_greedy", rows, dict(model=model, max_new=max_new, prompts=PROMPTS), md)
    print(benchlib.env_line() + "\n\n" + md)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="step_kernel_greedy_out")
    ap.add_argument("--model", required=True, help="a converted checkpoint directory with its tokenizer")
    ap.add_argument("--versions", default="3,5")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    main(a.out, a.model, [int(v) for v in a.versions.split(",")], a.max_tokens)
