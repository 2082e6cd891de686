"""pagedattn: PagedAttention from scratch, serving Qwen2.

    from pagedattn import LLM, SamplingParams
    llm = LLM()
    print(llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text)
"""
from pagedattn.llm import LLM
from pagedattn.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams"]
