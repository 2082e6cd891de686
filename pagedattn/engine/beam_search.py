"""Beam search on the engine, with beams forked copy-on-write.

Each prompt starts as one sequence. Whenever every live beam of a prompt has its next-token
log-probabilities (the engine stores them in `seq.logprobs` for sequences without SamplingParams),
the driver advances that prompt by one token:

1. candidates: each beam's top 2W tokens, scored cumulative_logprob + logprob (W = beam_width);
2. in score order, an end-of-sequence candidate ranked among the first W is a finished hypothesis
   (score = cumulative_logprob / generated_len ** length_penalty); the first W others are the new beams;
3. a beam chosen more than once is forked (`LLMEngine.fork`: the child shares every block; the
   partial last block is copied on the first write), a beam chosen by nobody is freed at once;
4. the prompt is done at max_tokens (the live beams become hypotheses too), when no beam is left,
   or when W hypotheses are finished and the best live beam can no longer beat the worst of them.

This is HF transformers' beam search (num_beams=W, do_sample=False, early_stopping=False) step for
step; the result is the W best hypotheses by score, best first.

Beams that wait for their siblings hold their blocks, so prompts run in groups whose worst case
(W x blocks of prompt + max_tokens each) fits the pool: beam search never preempts, and never waits
on blocks that only a waiting beam could free.
"""
from dataclasses import dataclass

from tqdm.auto import tqdm

from pagedattn.errors import InvalidRequestError
from pagedattn.sampling_params import SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list                  # prompt + generated ids (vLLM's shape)
    output_token_ids: list        # generated ids (an EOS that ended it included)
    text: str                     # the generated part, detokenized, special tokens skipped
    cumulative_logprob: float
    score: float                  # cumulative_logprob / len(output_token_ids) ** length_penalty
    finish_reason: str            # "stop" (EOS) | "length"


@dataclass
class BeamSearchOutput:
    prompt: object
    prompt_token_ids: list
    sequences: list               # [BeamSearchSequence], best first (beam_width of them)


class _PromptBeams:
    def __init__(self, request_id, prompt, prompt_ids, root):
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.beams = [root]
        self.finished = []        # (score, cumulative_logprob, output ids, reason)
        self.done = False


def beam_search(engine, prompts, params, use_tqdm=True):
    """Run beam search for every prompt (str or token ids). Returns [BeamSearchOutput]."""
    width, bs = params.beam_width, engine.config.block_size
    check = SamplingParams(temperature=0.0, max_tokens=params.max_tokens)
    prompt_ids = []
    for i, p in enumerate(prompts):
        try:
            prompt_ids.append(engine.validate_request(p, check, beam_width=width))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"request {i}: {e}") from e

    results = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="Beam search", unit="req", disable=not use_tqdm, dynamic_ncols=True)
    order = list(range(len(prompts)))
    while order:                                    # groups of prompts whose worst case fits the pool
        group, used = [], 0
        for i in order:
            need = width * -(-(len(prompt_ids[i]) + params.max_tokens) // bs)
            if group and used + need > engine.num_blocks:
                break
            group.append(i)
            used += need
        order = order[len(group):]
        for i, out in zip(group, _run_group(engine, [prompts[i] for i in group], [prompt_ids[i] for i in group],
                                            params, bar)):
            results[i] = out
    bar.close()
    return results


def _run_group(engine, prompts, prompt_ids, params, bar):
    states = []
    for prompt, ids in zip(prompts, prompt_ids):
        rid = f"beam-{next(engine.seq_ids)}"
        root = engine.add_beam_root(rid, ids, params.beam_width).seqs[0]
        states.append(_PromptBeams(rid, prompt, ids, root))
    try:
        while not all(s.done for s in states):
            outs = engine.step()
            engine.deferred_outputs.extend(outs)     # other requests' outputs: for their own caller
            for s in states:
                if not s.done and all(b.logprobs is not None for b in s.beams):
                    _advance(engine, s, params)
                    if s.done:
                        bar.update(1)
    finally:
        for s in states:
            engine.abort_request(s.request_id)      # frees whatever beams are left
    return [_output(engine, s, params) for s in states]


def _advance(engine, s, params):
    width, lp = params.beam_width, params.length_penalty
    eos = set() if params.ignore_eos else engine.eos_token_ids
    candidates = []                                 # (score, beam order, token rank, beam, token)
    for bi, beam in enumerate(s.beams):
        values, tokens = beam.logprobs.topk(min(2 * width, beam.logprobs.shape[-1]))
        for r, (v, t) in enumerate(zip(values.tolist(), tokens.tolist())):
            candidates.append((beam.cumulative_logprob + v, bi, r, beam, t))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))

    chosen = []
    for rank, (score, _, _, beam, token) in enumerate(candidates):
        if token in eos:
            if rank < width:
                out = beam.output_token_ids + [token]
                s.finished.append((score / len(out) ** lp, score, out, "stop"))
            continue
        chosen.append((score, beam, token))
        if len(chosen) == width:
            break

    for beam in s.beams:
        beam.num_pending_forks = 0
    # Fork before any beam gets its new token: a child copies its parent's tokens.
    taken, plan = set(), []
    for score, beam, token in chosen:
        if beam.seq_id in taken:
            seq = engine.fork(beam, index=len(plan))
        else:
            taken.add(beam.seq_id)
            seq = beam
        plan.append((seq, token, score))
    for beam in s.beams:
        if beam.seq_id not in taken:
            engine.free_sequence(beam)              # dropped: its blocks go back (shared ones lose a ref)
    for seq, token, score in plan:
        seq.token_ids.append(token)
        seq.cumulative_logprob = score
        seq.logprobs = None
    s.beams = [seq for seq, _, _ in plan]

    s.finished = sorted(s.finished, key=lambda f: -f[0])[:width]
    gen_len = s.beams[0].num_output_tokens if s.beams else 0
    if not s.beams or gen_len >= params.max_tokens:
        for seq in s.beams:
            s.finished.append((seq.cumulative_logprob / gen_len ** lp, seq.cumulative_logprob,
                               seq.output_token_ids, "length"))
        s.done = True
    elif len(s.finished) == width:
        best_running = s.beams[0].cumulative_logprob / gen_len ** lp
        s.done = s.finished[-1][0] >= best_running
    if s.done:
        for seq in s.beams:
            engine.free_sequence(seq)
        s.beams = []


def _output(engine, s, params):
    best = sorted(s.finished, key=lambda f: -f[0])[:params.beam_width]
    seqs = [BeamSearchSequence(s.prompt_ids + out, out, engine.detokenize(out), cum, score, reason)
            for score, cum, out, reason in best]
    return BeamSearchOutput(s.prompt, s.prompt_ids, seqs)
