"""The engine core's admission rule (--prefill-delay-factor) without HTTP: a closed-loop chat-like load on an
EngineCore over the synthetic device (pagedattn/serving/fake_engine.py: a step takes STEP_MS, one holding a
prompt chunk PREFILL_MS more, as an eager step on a GPU). CONC requests at once (prompts of 20-200 tokens,
8-160 output tokens), each finished one replaced by a new one 4 ms later, until NREQ finished; per factor:
tok/s, the share of steps holding a prefill, ITL and TTFT percentiles, the process's CPU per 1000 tokens.

    python scripts/bench_admission.py STEP_MS PREFILL_MS CONC NREQ [FACTOR ...]     # e.g. 3 30 64 400 0 1 2
"""
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

from pagedattn import LLM, SamplingParams  # noqa: E402
from pagedattn.bundled import bundled_model_path  # noqa: E402
from pagedattn.serving.engine_core import AddRequest, EngineCore, decode_step  # noqa: E402
from pagedattn.serving.fake_engine import install_fake_executor  # noqa: E402

MODEL = bundled_model_path()
S, P, CONC, NREQ, RTT = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 0.004

def run(factor):
    llm = install_fake_executor(LLM(MODEL, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=CONC,
                                    num_blocks=4096, enable_prefix_caching=False), S, prefill_ms=P)
    ex = llm.engine.executor; execute = ex.execute; kinds = []
    def counting(step):
        kinds.append(step.num_prefills > 0); return execute(step)
    ex.execute = counting
    core = EngineCore(llm, f"ipc://{tempfile.mkdtemp()}/c", prefill_delay_factor=factor)
    rng = random.Random(0); due = []; last = {}; itl = []; ttft = {}; arrived = {}; done = [0]; ntok = [0]
    def sink(client, msg):
        t = time.perf_counter(); st = decode_step(msg)
        for wid, k in zip(st["wire_ids"].tolist(), st["num_tokens"].tolist()):
            if not k: continue
            ntok[0] += k
            if wid in last: itl.append((t - last[wid]) / k)
            else: ttft[wid] = t - arrived[wid]
            last[wid] = t
        for wid in st["finished"]:
            done[0] += 1
            due.append(t + RTT)
    core._send = sink
    wid = 0
    def arrive(t):
        nonlocal wid
        wid += 1; arrived[wid] = t
        core.held.append(AddRequest(b"c", wid, [rng.randrange(1, 1000) for _ in range(rng.randint(20, 200))],
                                    SamplingParams(max_tokens=rng.randint(8, 160))))
    t0 = time.perf_counter(); c0 = time.process_time()
    for _ in range(CONC): arrive(t0)
    while done[0] < NREQ:
        t = time.perf_counter()
        while due and due[0] <= t and wid < NREQ + CONC:
            due.pop(0); arrive(t)
        if core.held: core._admit_due()
        if llm.engine.has_unfinished_requests(): core._step()
        else: time.sleep(0.0005)
    wall = time.perf_counter() - t0; cpu = time.process_time() - c0
    core.close()
    print(f"factor {factor}: {ntok[0]/wall:8.0f} tok/s, steps {len(kinds)}, with a prefill {sum(kinds)} "
          f"({100*sum(kinds)/len(kinds):.0f}%), ITL p50 {1e3*np.median(itl):.2f} ms "
          f"p90 {1e3*np.percentile(itl,90):.2f}, "
          f"TTFT p50 {1e3*np.median(list(ttft.values())):.1f} ms, CPU {1e3*cpu/ntok[0]*1000:.0f} ms/ktok", flush=True)
for f in [float(x) for x in sys.argv[5:]] or (0.0, 2.0):
    run(f)
