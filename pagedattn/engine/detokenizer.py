"""Text of a completion as its tokens arrive, for streaming and stop strings.

    detok = IncrementalDetokenizer(tokenizer, stop=["\\n\\n"])
    for token in tokens:
        if detok.add(token):            # True once a stop string appeared: text is cut before it
            break
    detok.releasable                    # text that can be shown now

Two things make this more than `tokenizer.decode(ids[-1:])`:
  * a character can span several tokens (UTF-8 bytes of byte-level BPE): tokens are fed to the
    tokenizer's own streaming decoder (`tokenizers.decoders.DecodeStream`), which returns text only
    once it is complete;
  * a stop string can span tokens: the tail of the text that could still be the start of a stop string
    is held back (`releasable` excludes it) until the next tokens rule it in or out, so a stop string
    never leaks into streamed text.
`finish()` gives the final text: the whole decode (what `tokenizer.decode(ids, skip_special_tokens=True)`
returns, cut before the first stop string), which the released text is always a prefix of.
"""


class IncrementalDetokenizer:
    """tokenizer: a HF fast tokenizer (or None: no text); stop: list of non-empty stop strings."""

    def __init__(self, tokenizer, stop=()):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend is not None else None
        self.stop = list(stop)
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids = []
        self.text = ""              # decoded so far (cut at a stop string once one appeared)
        self.stopped = False

    def add(self, token_id):
        """Append one token. Returns True when a stop string completed (text is then cut before it)."""
        self.token_ids.append(token_id)
        if self.stream is not None and not self.stopped:
            chunk = self.stream.step(self.backend, token_id)
        elif self.tokenizer is None or self.stopped:
            return self.stopped
        else:                                           # a slow tokenizer: decode the tail again
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            chunk = "" if full.endswith("\ufffd") else full[len(self.text):]
        if not chunk:
            return False
        if not self.stop:
            self.text += chunk
            return False
        start = max(0, len(self.text) - self.max_stop + 1)       # a stop string may end inside the chunk
        self.text += chunk
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    @property
    def releasable(self):
        """The prefix of text that no later token can take back (held: a partial stop string)."""
        if self.stopped or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self.text[:len(self.text) - hold]

    def finish(self):
        """The final text (the completion's tokens are all in)."""
        if self.tokenizer is None:
            return ""
        if self.stopped:
            return self.text
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for s in self.stop:                             # (a stop string completed by bytes still pending)
            i = full.find(s)
            if i >= 0:
                full = full[:i]
        return full
