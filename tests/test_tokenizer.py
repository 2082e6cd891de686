"""The engine's tokenizer (transformers' backend tokenizer, kept on disk and read back by the `tokenizers`
library) gives the ids and the text of transformers' tokenizer of the same checkpoint, and hands everything
else to that tokenizer. Checked on the bundled Qwen2 tokenizer and on the serving tests' tiny trained one
(whose tokenizer.json pre-tokenizer transformers replaces with Qwen2's)."""
import random

import pytest

from pagedattn.engine.tokenizer import Tokenizer, load_tokenizer
from tests.helpers import bundled_model_dir  # noqa: F401 - fixture
from tests.serving_helpers import write_tiny_chat_checkpoint

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Hello, world! It's   a test ... isn't it ?  Yes , it 's .",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<tool_call>{\"name\": \"f\"}</tool_call> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "Unicode: naïve café — 東京 👩‍💻 ∑x² \t\ttabs\r\nCRLF   trailing   ",
    "",
    " leading space",
    "a" * 300,
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tinychat"))


@pytest.fixture(scope="module", params=["bundled", "tiny"])
def pair(request, tmp_path_factory):
    """(the engine's tokenizer read back from the disk cache, transformers' tokenizer) of one checkpoint."""
    from transformers import AutoTokenizer

    path = request.getfixturevalue("bundled_model_dir" if request.param == "bundled" else "tiny_dir")
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    first = load_tokenizer(path, in_a_child=False)      # through transformers here, then saved
    second = load_tokenizer(path)                       # from the disk cache, transformers untouched
    mp.undo()
    assert isinstance(first, Tokenizer) and isinstance(second, Tokenizer)
    assert first._hf is not None and second._hf is None
    yield second, AutoTokenizer.from_pretrained(path)


_FRESH_LOAD = """
import json, sys
from pagedattn.engine.tokenizer import Tokenizer, _cache_file, load_tokenizer
tok = load_tokenizer(sys.argv[1])
import os
from pagedattn.engine.detokenizer import IncrementalDetokenizer
detok = IncrementalDetokenizer(tok, ["zz"])     # (a server's text: streamed through the same tokenizer)
for t in tok.encode("def fib(n):", add_special_tokens=False):
    detok.add(t)
print(json.dumps(dict(ours=isinstance(tok, Tokenizer), hf_loaded=tok._hf is not None, cached=os.path.isfile(
    _cache_file(sys.argv[1])), transformers="transformers" in sys.modules, ids=tok.encode("def fib(n):"),
    text=detok.finish())))
"""


def test_a_first_load_builds_in_a_child_process(tiny_dir, tmp_path):
    """On an empty cache the tokenizer is built by a child process, which saves it; this process reads the
    saved file and never imports transformers (whose import and build would hold its GIL), with the ids
    transformers gives; detokenizing a stream of tokens does not import it either."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    env = dict(os.environ, PAGEDATTN_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-c", _FRESH_LOAD, tiny_dir], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ours"] and out["cached"] and not out["hf_loaded"] and not out["transformers"], out
    assert out["ids"] == AutoTokenizer.from_pretrained(tiny_dir).encode("def fib(n):", add_special_tokens=True)
    assert out["text"] == AutoTokenizer.from_pretrained(tiny_dir).decode(
        AutoTokenizer.from_pretrained(tiny_dir).encode("def fib(n):", add_special_tokens=False), skip_special_tokens=True)


def test_a_converted_checkpoint_keeps_its_tokenizer_beside_it(tiny_dir, tmp_path, monkeypatch):
    """A checkpoint written with keep_beside (what pagedattn.bundled.convert_gguf does) keeps the saved
    tokenizer in its own directory: a process with an empty cache directory reads it there, with no build
    (no child process, no transformers); a copy whose key no longer matches the tokenizer files (a file
    changed since) is not used; a damaged copy is not either."""
    import json
    import os
    import shutil

    from pagedattn.engine import tokenizer as T

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "convert_cache"))
    built = load_tokenizer(str(ckpt), in_a_child=False, keep_beside=True)
    assert (ckpt / T.BESIDE).is_file()
    children = []
    monkeypatch.setattr(T, "_build_in_a_child", lambda path: children.append(path))
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "empty_cache"))
    tok = load_tokenizer(str(ckpt))
    assert isinstance(tok, Tokenizer) and tok._hf is None and children == []
    assert tok.encode("def fib(n):") == built.encode("def fib(n):") and tok.eos_token_id == built.eos_token_id
    assert not os.path.exists(T._cache_file(str(ckpt)))        # read beside the checkpoint, not copied

    config = ckpt / "tokenizer_config.json"               # a tokenizer file changes: the copy's key is stale
    config.write_text(json.dumps(dict(json.loads(config.read_text()), model_max_length=77)))
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "empty_cache2"))
    rebuilt = load_tokenizer(str(ckpt))                   # (this process imported transformers: built here)
    assert rebuilt._hf is not None and rebuilt.hf.model_max_length == 77

    (ckpt / T.BESIDE).write_text("{not json")
    assert T._load_cached(str(ckpt), str(ckpt / T.BESIDE), key="x") is None


def test_encode_matches_transformers(pair):
    ours, hf = pair
    for text in TEXTS + ["The paged KV cache 1 cache ", "x = 12345 + 678"]:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text


def test_decode_matches_transformers(pair):
    ours, hf = pair
    rng = random.Random(0)
    n = len(hf)
    cases = [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    cases += [[rng.randrange(n) for _ in range(rng.randrange(1, 40))] for _ in range(200)]   # specials too
    cases += [[n - 1, 5, n - 2, 7], [n - 3, 0, 1, n - 1]]                                 # added tokens
    for ids in cases:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_special_ids_and_delegation(pair):
    ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id is not None
    assert len(ours) == len(hf)
    assert ours.convert_ids_to_tokens([len(hf) - 1, 3]) == hf.convert_ids_to_tokens([len(hf) - 1, 3])
    messages = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))   # delegated
    assert ours.hf is ours.hf                                                                  # loaded once


def test_checkpoints_without_tokenizer_json(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None                    # token ids only


def test_llm_get_tokenizer_is_transformers(bundled_model_dir):  # noqa: F811
    from transformers import PreTrainedTokenizerBase

    from pagedattn import LLM
    llm = LLM(bundled_model_dir, device="cpu", num_blocks=16, max_model_len=64)
    assert isinstance(llm.engine.tokenizer, Tokenizer)
    assert isinstance(llm.get_tokenizer(), PreTrainedTokenizerBase)
    llm.close()
