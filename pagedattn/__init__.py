"""pagedattn: PagedAttention from scratch, serving Qwen2.

    from pagedattn import LLM, SamplingParams
    llm = LLM()
    print(llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text)

The names are loaded on first use, so importing one module (a kernel, the block manager) loads only what
that module needs.
"""
import importlib

__all__ = ["LLM", "SamplingParams", "BeamSearchParams"]
_HOMES = {"LLM": "pagedattn.llm", "SamplingParams": "pagedattn.sampling_params",
          "BeamSearchParams": "pagedattn.sampling_params"}


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
