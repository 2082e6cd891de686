"""How far one request travels through the code: the project's files and functions a step enters.

A reader follows a request from `LLM.generate` to the kernels and back; this counts how much code that
walk crosses. It builds a tiny random Qwen2 on the CPU, brings a few requests to pure decoding, then
records (with sys.setprofile) every function of pagedattn/ and kernels_numba/ that Python enters during

    step        one pure-decode `engine.step()`
    generate    one `LLM.generate` of two short prompts (prefill, decode, the output's way out)

and prints, per walk, the number of files and of distinct functions, then the files with their functions.
Compiled kernel bodies (numba) are not Python frames: a kernel call counts as the function that launches it.

    python scripts/trace_step.py              # both walks, a table per walk
    python scripts/trace_step.py --json OUT   # the same as JSON
"""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = tuple(os.path.join(ROOT, p) + os.sep for p in ("pagedattn", "kernels_numba"))


def record(fn):
    """Run fn() under a profile hook; returns {file (relative): sorted function names} of the project's
    Python functions it entered."""
    seen = {}

    def hook(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PACKAGES):
                seen.setdefault(os.path.relpath(path, ROOT), set()).add(frame.f_code.co_qualname)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {f: sorted(names) for f, names in sorted(seen.items())}


def tiny_llm(workdir):
    """An LLM over a tiny random Qwen2 checkpoint on the CPU (tests/helpers.py writes it)."""
    sys.path.insert(0, ROOT)
    from pagedattn import LLM
    from tests.helpers import write_tiny_checkpoint

    path = write_tiny_checkpoint(os.path.join(workdir, "tiny"))
    return LLM(path, device="cpu", num_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


def walks(llm):
    """{walk name: {file: functions}}."""
    from pagedattn import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate([[1, 2, 3, 4, 5], [6, 7, 8]]):
        engine.add_request(f"r{i}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):                                    # compile and warm everything a decode step runs
        engine.step()
    step = record(engine.step)
    while engine.has_unfinished_requests():
        engine.step()
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)                  # warm
    generate = record(lambda: llm.generate([[9, 8, 7], [3, 2, 1, 4]], params, use_tqdm=False))
    return {"step": step, "generate": generate}


def main(json_out=None):
    with tempfile.TemporaryDirectory() as workdir:
        result = walks(tiny_llm(workdir))
    for name, files in result.items():
        n_functions = sum(len(v) for v in files.values())
        print(f"\n{name}: {len(files)} files, {n_functions} distinct functions")
        for f, names in files.items():
            print(f"  {f:45s} {len(names):3d}  {', '.join(names)}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write {walk: {file: functions}} here")
    main(ap.parse_args().json)
