"""The engine's tokenizer: transformers' tokenizer of the checkpoint, as the `tokenizers` library object it
wraps, kept on disk so that later processes load it without importing transformers.

What the engine needs — encode a prompt, decode tokens, the end-of-sequence id — is what transformers'
fast tokenizer hands to its Rust tokenizer (`backend_tokenizer`). transformers builds that object from the
checkpoint's files and its own code (a model's tokenizer class may set its pre-tokenizer itself, so it is
not always tokenizer.json as written); the first load on a machine therefore goes through transformers,
and the object it built is saved (`backend_tokenizer.to_str()`) under ~/.cache/pagedattn/tokenizers/, keyed
by the checkpoint's tokenizer files and the transformers and tokenizers versions (a checkpoint converted by
pagedattn.bundled keeps a copy in its own directory too); that first build runs in a
process of its own (this module as a script), so the engine's process, loading the model meanwhile, never shares
its GIL with transformers. Every load reads that file with the `tokenizers` library: ~0.4 s instead of the
seconds transformers takes to import. Anything else (apply_chat_template, the special-token maps, ...) goes to
transformers' tokenizer, loaded on first use, and `LLM.get_tokenizer()` returns that one. tests/test_tokenizer.py checks that both give the same ids and text.
"""
import json
import os
import threading

CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """encode / decode / eos_token_id through a `tokenizers.Tokenizer`; every other attribute from
    transformers' tokenizer of the same directory (`hf`, loaded once, on first use, thread-safe)."""

    def __init__(self, path, rust, eos_token_id, clean_up_tokenization_spaces=False, hf=None):
        self.path, self._tk = path, rust
        self.eos_token_id = eos_token_id
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self._hf, self._lock = hf, threading.Lock()

    @classmethod
    def from_transformers(cls, path, hf):
        return cls(path, hf.backend_tokenizer, hf.eos_token_id, getattr(hf, "clean_up_tokenization_spaces", False), hf)

    def encode(self, text, add_special_tokens=True):
        """text -> list[int]."""
        return self._encoding(text, add_special_tokens).ids

    def encode_bounded(self, text, max_length, add_special_tokens=True):
        """(number of tokens, their ids as a list[int], or None when there are more than max_length). A
        prompt too long to run is refused from its count alone: the list of a million-character prompt's
        ids (millions of ints, ~100 MB) is never built, which would cost tens of ms under the GIL."""
        enc = self._encoding(text, add_special_tokens)
        n = len(enc)
        return n, (enc.ids if n <= max_length else None)

    def _encoding(self, text, add_special_tokens):
        # `encode_batch_fast` (a batch of one, no character offsets) releases the GIL while the Rust code
        # works, where `encode` holds it throughout: a server tokenizes on a worker thread, and the seconds a
        # 1,000,000-character prompt takes must not stall its event loop.
        return self._tk.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, token_ids, skip_special_tokens=False):
        text = self._tk.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for a, b in CLEANUPS:
                text = text.replace(a, b)
        return text

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(i) for i in ids]

    def __len__(self):
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self):
        """The `tokenizers.Tokenizer` (transformers' name for it): the streaming decoders step through it
        without loading transformers' tokenizer."""
        return self._tk

    @property
    def hf(self):
        """transformers' tokenizer of the checkpoint (AutoTokenizer), loaded on first use."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    from transformers import AutoTokenizer
                    self._hf = AutoTokenizer.from_pretrained(self.path)
        return self._hf

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_hf", "_tk", "_lock", "path"):
            raise AttributeError(name)
        return getattr(self.hf, name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja")


BESIDE = "pagedattn_tokenizer.json"   # a converted checkpoint's own copy of the saved tokenizer (see load_tokenizer)


def _cache_file(path):
    """Where the tokenizer transformers builds for `path` is kept: named by the tokenizer files (name, size,
    mtime, and the content of the small ones) and the transformers and tokenizers versions."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from pagedattn.bundled import cache_root

    h = hashlib.sha256()
    try:
        h.update(f"{version('transformers')} {version('tokenizers')}".encode())
    except PackageNotFoundError:
        return None
    for name in TOKENIZER_FILES:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            st = os.stat(f)
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
            if st.st_size < (1 << 16):
                with open(f, "rb") as fh:
                    h.update(fh.read())
    return os.path.join(cache_root(), "tokenizers", h.hexdigest()[:32] + ".json")


def _load_cached(path, cached, key=None):
    """The Tokenizer saved at `cached`, or None when there is none or it is damaged (then it is rebuilt).
    key: the name the entry must have been saved under (the copy beside a checkpoint says it inside)."""
    if cached is None or not os.path.isfile(cached):
        return None
    try:
        from tokenizers import Tokenizer as RustTokenizer
        with open(cached) as f:
            saved = json.load(f)
        if key is not None and saved.get("key") != key:
            return None
        return Tokenizer(path, RustTokenizer.from_str(saved["tokenizer"]), saved["eos_token_id"],
                         saved["clean_up_tokenization_spaces"])
    except (OSError, ValueError, KeyError, Exception):  # noqa: BLE001 - a damaged entry: rebuild it
        return None


def _save(file, tokenizer, tok, key):
    """Write the saved form of `tok` (transformers' `tokenizer` behind it) to `file`, atomically; `key` (the
    cache file's name) inside, which the copy beside a checkpoint is checked against."""
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        tmp = f"{file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(tokenizer=tokenizer.backend_tokenizer.to_str(), eos_token_id=tok.eos_token_id,
                           clean_up_tokenization_spaces=tok.clean_up_tokenization_spaces,
                           key=key), f)
        os.replace(tmp, file)
    except OSError:
        pass


def _key(cached):
    return os.path.basename(cached).removesuffix(".json")


def _build_in_a_child(path):
    """Build the cached tokenizer of `path` in a process of its own (this module run as a script): importing
    transformers and building the tokenizer is seconds of Python (~17 s on a host without compiled bytecode),
    which on a thread of the engine's process holds the GIL the model's load and the kernels' warm-up need."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        subprocess.run([sys.executable, "-m", "pagedattn.engine.tokenizer", path], env=env, timeout=900,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        pass                                 # built in this process instead


def load_tokenizer(path, in_a_child=True, keep_beside=False):
    """The checkpoint's tokenizer (a Tokenizer; transformers' own when it is not a fast one), or None for a
    checkpoint without one (token ids only). in_a_child: when the tokenizer is not cached yet, build it in a
    process of its own and load what it saved (transformers stays out of this process), unless this process
    imported transformers already; False: here.

    A checkpoint this project wrote (pagedattn.bundled.convert_gguf, keep_beside=True) also keeps the saved
    tokenizer in its own directory (BESIDE, under the same key: the tokenizer files as they are there and the
    transformers and tokenizers versions), so a process with an empty cache directory reads that instead of
    building it again through transformers (seconds of imports on a host without compiled bytecode)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                               "vocab.json")):
        return None
    import sys

    cached = _cache_file(path)
    beside = os.path.join(path, BESIDE)
    tok = _load_cached(path, cached)
    if tok is None and cached is not None:
        tok = _load_cached(path, beside, key=_key(cached))
    if tok is None and cached is not None and in_a_child and "transformers" not in sys.modules:
        _build_in_a_child(path)         # (a process that imported transformers already builds it in a moment)
        tok = _load_cached(path, cached)
    if tok is not None and not keep_beside:
        return tok
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(path)
    if getattr(hf, "backend_tokenizer", None) is None:
        return hf
    tok = Tokenizer.from_transformers(path, hf)
    if cached is not None:
        _save(cached, hf, tok, _key(cached))
        if keep_beside:
            _save(beside, hf, tok, _key(cached))
    return tok


if __name__ == "__main__":               # the child of _build_in_a_child: build and save the cached tokenizer
    import sys

    load_tokenizer(sys.argv[1], in_a_child=False)
