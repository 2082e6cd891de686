"""ServeConfig: `python -m pagedattn serve`'s arguments parsed once, into one object every process gets.

Checked: no flag means every default is ServeConfig's and every engine option EngineConfig's (the engine
dict holds only what was given); each engine flag lands on its LLM keyword; the engine hook and its
arguments (values read as JSON); bad values stop the command naming the field; the object survives pickling
as spawn sends it; build_llm applies the hook to the LLM it builds; the headless engine core parses its
options with the same parser into the same ServeConfig.
"""
import pickle

import pytest
from helpers import tiny_checkpoint  # noqa: F401  (session fixture)

from pagedattn.serving import engine_core
from pagedattn.serving.cli import parse_config
from pagedattn.serving.config import ServeConfig, ServerLimits
from scripts import fake_engine


@pytest.fixture(autouse=True)
def no_api_key_in_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_API_KEY", raising=False)


def test_no_flags_give_the_defaults():
    config = parse_config([])
    assert config == ServeConfig() and config.engine == {} and config.limits == ServerLimits()


def test_engine_flags_become_llm_keywords():
    config = parse_config(["--model", "M", "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
                           "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--num-blocks", "9",
                           "--block-size", "8", "--tensor-parallel-size", "1", "--no-prefix-caching",
                           "--enforce-eager", "--no-piecewise-graphs", "--prefill-delay-factor", "0",
                           "--max-prompt-chars", "100", "--in-process", "--port", "0", "--step-kernel", "off"])
    assert config.engine == dict(model="M", device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                                 max_num_batched_tokens=64, num_blocks=9, block_size=8, tensor_parallel_size=1,
                                 enable_prefix_caching=False, enforce_eager=True, piecewise_graphs=False,
                                 step_kernel="off")
    assert config.prefill_delay_factor == 0 and config.limits.max_prompt_chars == 100
    assert config.in_process and config.port == 0


def test_the_engine_hook_and_its_arguments():
    config = parse_config(fake_engine.serve_flags(2.5, 40) + ["--engine-hook-arg", "note=fast steps"])
    assert config.engine_hook == "scripts.fake_engine:install_fake_runner"
    assert config.engine_hook_args == {"step_ms": 2.5, "prefill_ms": 40, "note": "fast steps"}
    assert config.hook() is fake_engine.install_fake_runner
    with pytest.raises(ValueError, match="cannot be loaded"):
        ServeConfig(engine_hook="scripts.fake_engine:no_such_function").hook()


BAD = [  # (flags, words of the error)
    (["--max-model-len", "0"], "max_model_len"),
    (["--device", "tpu"], "device"),
    (["--stream-interval", "0"], "stream_interval"),
    (["--api-server-count", "0"], "api_server_count"),
    (["--shutdown-timeout", "-1"], "shutdown_timeout_s"),
    (["--prefill-delay-factor", "-1"], "prefill_delay_factor"),
    (["--max-body-bytes", "0"], "max_body_bytes"),
    (["--engine-hook", "no_function_named"], "engine_hook"),
    (["--engine-hook-arg", "step_ms=2"], "engine_hook_args given without an engine_hook"),
    (["--engine-core-address", "udp://x:1"], "engine_core_addresses"),
    (["--in-process", "--api-server-count", "2"], "in_process runs one engine"),
]


@pytest.mark.parametrize("flags,words", BAD, ids=[w for _, w in BAD])
def test_a_bad_value_stops_the_command_naming_the_field(capsys, flags, words):
    with pytest.raises(SystemExit) as e:
        parse_config(flags)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_an_unknown_engine_option_is_refused():
    with pytest.raises(ValueError, match="bogus"):
        ServeConfig(engine={"bogus": 1})


def test_the_config_travels_as_it_is():
    """What spawn does with it: pickled and unpickled, equal (the hook as its name, imported where it runs)."""
    config = parse_config(["--device", "cpu", "--data-parallel-size", "2", *fake_engine.serve_flags(3)])
    assert pickle.loads(pickle.dumps(config)) == config


def test_build_llm_applies_the_hook(tiny_checkpoint):  # noqa: F811
    config = parse_config(["--model", tiny_checkpoint, "--device", "cpu", "--num-blocks", "8",
                           *fake_engine.serve_flags(7)])
    llm = engine_core.build_llm(config)
    try:
        assert isinstance(llm.engine.runner, fake_engine.FakeRunner) and llm.engine.runner.step_s == 0.007
        assert llm.engine.num_blocks == 8
    finally:
        llm.close()


def test_the_headless_core_takes_the_same_config(monkeypatch):
    got = []
    monkeypatch.setattr(engine_core, "run_engine_core", lambda *args: got.append(args))
    flags = ["--model", "M", "--device", "cpu", "--prefill-delay-factor", "0.5"]
    engine_core.main(["--bind", "tcp://127.0.0.1:5550", "--rank", "1", *flags])
    assert got == [(parse_config(flags), "tcp://127.0.0.1:5550", 1)]
