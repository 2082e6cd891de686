"""A token's text and bytes for the logprobs of a response, and the tokenizer's control tokens.

The detokenizer (pagedattn.engine.detokenizer) makes a completion's text; here each token gets its own share
of it: TokenPieces gives every token the characters it completes (a character split over several tokens
belongs to the last of them), so the pieces join to the text and the completions API's text_offset points
into it; token_bytes gives a byte-level BPE token's own bytes (chat's logprobs `bytes`).
"""


class TokenPieces:
    """Each token's share of a completion's text, token by token: the characters it completes. A character
    whose UTF-8 bytes span several tokens belongs to the token that completes it (the tokens before get ""),
    so no piece holds a replacement character '\ufffd' and the pieces join to the decoded text (special
    tokens skipped), which makes the completions API's text_offset an offset into that text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(skip_special_tokens=True)
        self.ids, self.text = [], ""

    def step(self, token_id):
        if self.backend is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)       # a slow tokenizer: decode the whole again
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd") or not full.startswith(self.text):
            return ""
        piece, self.text = full[len(self.text):], full
        return piece


def _byte_level_decoder():
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()


def token_bytes(tokenizer, token_id, text):
    """The UTF-8 bytes a token stands for: for a byte-level BPE token its own bytes (part of a character,
    maybe), otherwise the bytes of its text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteLevel" in repr(backend.decoder):
        token = tokenizer.convert_ids_to_tokens(token_id)
        special = token_id in getattr(tokenizer, "all_special_ids", ())
        if isinstance(token, str) and token and not special and all(ch in _BYTE_LEVEL for ch in token):
            return [_BYTE_LEVEL[ch] for ch in token]
    return list(text.encode("utf-8"))


def control_tokens(tokenizer):
    """The tokenizer's added tokens (<|im_start|>, <|im_end|>, ...): strings its encoder turns into one
    control token wherever they appear in text."""
    if tokenizer is None:
        return ()
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names = {getattr(t, "content", str(t)) for t in added.values()} | set(getattr(tokenizer, "all_special_tokens", ()))
    return tuple(sorted(n for n in names if n))
