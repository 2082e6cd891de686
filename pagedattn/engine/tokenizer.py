"""The engine's tokenizer: the checkpoint's tokenizer.json read by the `tokenizers` library, with
transformers' tokenizer loaded only when something else is asked of it.

What the engine needs — encode a prompt, decode tokens, the end-of-sequence id — is what transformers'
fast tokenizer delegates to the `tokenizers` library anyway (its encode/decode call the same Rust
tokenizer on the same tokenizer.json), so reading the file directly gives the same ids and text in
~0.4 s instead of the seconds transformers takes to import. Anything else (apply_chat_template, the
special-token maps, save_pretrained, ...) goes to the transformers tokenizer, loaded on first use, and
`LLM.get_tokenizer()` returns that one. tests/test_tokenizer.py checks the two agree.
"""
import json
import os
import threading

CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """encode / decode / eos_token_id from tokenizer.json; every other attribute from transformers'
    tokenizer of the same directory (loaded once, on first use, thread-safe)."""

    def __init__(self, path):
        from tokenizers import Tokenizer as RustTokenizer

        self.path = path
        self._tk = RustTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        try:
            with open(os.path.join(path, "tokenizer_config.json")) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError):
            config = {}
        eos = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tk.token_to_id(eos) if eos else None
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._hf, self._lock = None, threading.Lock()

    def encode(self, text, add_special_tokens=True):
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

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


def load_tokenizer(path):
    """The checkpoint's tokenizer: a Tokenizer over tokenizer.json when there is one, else transformers'
    (a directory with vocab.json/merges.txt only), or None for a checkpoint without one (token ids only)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return Tokenizer(path)
    files = ("tokenizer_config.json", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
