"""Beam search inside the engine's step, with beams forked copy-on-write.

A beam-search request starts as one sequence without SamplingParams. Each step the runner returns, for
every beam that caught up, its top 2W next-token log-probabilities (W = beam_width); once every live beam
of a request has them, `BeamState.advance` (called by the engine within the same step) moves the request
by one token:

1. candidates: each beam's top 2W tokens, scored cumulative_logprob + logprob;
2. in score order, an end-of-sequence candidate ranked among the first W is a finished hypothesis
   (score = cumulative_logprob / generated_len ** length_penalty); the first W others are the new beams;
3. a beam chosen more than once is forked (`LLMEngine.fork`: the child shares every block; the
   partial last block is copied on the first write), a beam chosen by nobody is freed at once;
4. the request is done at max_tokens (the live beams become hypotheses too), when no beam is left,
   or when W hypotheses are finished and the best live beam can no longer beat the worst of them.

This is HF transformers' beam search (num_beams=W, do_sample=False, early_stopping=False) step for
step; the result is the W best hypotheses by score, best first, as the request's completions.

Beams that wait for their siblings hold their blocks, so LLM.beam_search admits prompts in groups
whose worst case (W x blocks of prompt + max_tokens each) fits the pool: beam search never preempts,
and never waits on blocks that only a waiting beam could free.
"""
from dataclasses import dataclass

from pagedattn.engine.outputs import CompletionOutput


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


class BeamState:
    """The live beams and finished hypotheses of one request. params: BeamSearchParams."""

    def __init__(self, params, root):
        self.params = params
        self.beams = [root]
        self.finished = []        # (score, cumulative_logprob, output ids, reason)
        self.done = False

    @property
    def ready(self):
        return not self.done and all(b.beam_candidates is not None for b in self.beams)

    def advance(self, engine):
        """One token for every beam (see the module docstring). engine: the LLMEngine (fork/free)."""
        width, lp = self.params.beam_width, self.params.length_penalty
        eos = set() if self.params.ignore_eos else engine.eos_token_ids
        candidates = []                                 # (score, beam order, token rank, beam, token)
        for bi, beam in enumerate(self.beams):
            values, tokens = beam.beam_candidates
            for r, (v, t) in enumerate(zip(values[:2 * width].tolist(), tokens[:2 * width].tolist())):
                candidates.append((beam.cumulative_logprob + v, bi, r, beam, t))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))

        chosen = []
        for rank, (score, _, _, beam, token) in enumerate(candidates):
            if token in eos:
                if rank < width:
                    out = beam.output_token_ids + [token]
                    self.finished.append((score / len(out) ** lp, score, out, "stop"))
                continue
            chosen.append((score, beam, token))
            if len(chosen) == width:
                break

        for beam in self.beams:
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
        for beam in self.beams:
            if beam.seq_id not in taken:
                engine.free_sequence(beam)              # dropped: its blocks go back (shared ones lose a ref)
        for seq, token, score in plan:
            seq.token_ids.append(token)
            seq.cumulative_logprob = score
            seq.beam_candidates = None
        self.beams = [seq for seq, _, _ in plan]

        self.finished = sorted(self.finished, key=lambda f: -f[0])[:width]
        gen_len = self.beams[0].num_output_tokens if self.beams else 0
        if not self.beams or gen_len >= self.params.max_tokens:
            for seq in self.beams:
                self.finished.append((seq.cumulative_logprob / gen_len ** lp, seq.cumulative_logprob,
                                      seq.output_token_ids, "length"))
            self.done = True
        elif len(self.finished) == width:
            best_running = self.beams[0].cumulative_logprob / gen_len ** lp
            self.done = self.finished[-1][0] >= best_running
        if self.done:
            for seq in self.beams:
                engine.free_sequence(seq, "length")
            self.beams = []

    def completions(self, detokenize):
        """The W best hypotheses, best first, as CompletionOutputs."""
        return [CompletionOutput(i, detokenize(out), out, reason, cum)
                for i, (score, cum, out, reason) in enumerate(self.best())]

    def best(self):
        return sorted(self.finished, key=lambda f: -f[0])[:self.params.beam_width]


def beam_search_output(prompt, prompt_ids, state, detokenize):
    return BeamSearchOutput(prompt, prompt_ids, [
        BeamSearchSequence(prompt_ids + out, out, detokenize(out), cum, score, reason)
        for score, cum, out, reason in state.best()])
