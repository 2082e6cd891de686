"""The benchmark scripts' own logic, on CPU: the problem they build, the calls they time, the tables they
write. (Their timings need the GPU; what they run and check must not wait for one.) The kernel benches'
checks are in tests/test_kernel_bench_scripts.py."""
import json
import os
from pathlib import Path

import pytest
import torch

# ---- scripts/benchlib.py ------------------------------------------------------------------------
from scripts import benchlib

TINY_SHAPES = dict(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)


def test_markdown_table_formats_every_kind_of_cell():
    rows = [{"run": "greedy", "tok/s": 18812.34, "ratio": 0.98765, "ids": [1, 2], "ok": True, "n": 142827},
            {"run": "a|b", "tok/s": None, "ratio": 1.0, "n": 7, "extra": "x"}]
    lines = benchlib.markdown_table(rows).splitlines()
    assert lines[0] == "| run | tok/s | ratio | ids | ok | n | extra |"
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2] == "| greedy | 18,812 | 0.988 | [1, 2] | yes | 142,827 |  |"
    assert lines[3] == "| a\\|b |  | 1 |  |  | 7 | x |"
    picked = benchlib.markdown_table(rows, ["ratio", "run"], floatfmt={"ratio": "{:.1f}"}).splitlines()
    assert picked[0] == "| ratio | run |" and picked[2] == "| 1.0 | greedy |"


def test_save_writes_json_and_markdown_with_the_env_line(tmp_path):
    rows = [{"batch": 1, "us": 7.25}, {"batch": 64, "us": 21.8}]
    paths = benchlib.save(str(tmp_path / "out"), "decode", rows, {"note": "test"})
    assert [os.path.basename(p) for p in paths] == ["decode.json", "decode.md"]
    data = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert data["rows"] == rows and data["meta"]["note"] == "test" and "torch" in data["meta"]["env"]
    md = (tmp_path / "out" / "decode.md").read_text().splitlines()
    assert md[0] == data["meta"]["env"] and md[2] == "| batch | us |" and md[5] == "| 64 | 21.8 |"
    benchlib.save(str(tmp_path), "custom", rows, {"env": "E"}, markdown="text")
    assert (tmp_path / "custom.md").read_text() == "E\n\ntext\n"


def test_num_sets_for_covers_three_l2s_within_bounds():
    l2 = benchlib.L2_BYTES
    for set_bytes in (1 << 10, 2 << 20, 7 << 20, 40 << 20, 1 << 30):
        n = benchlib.num_sets_for(set_bytes)
        assert 4 <= n <= 64
        assert n * set_bytes >= 3 * l2 or n == 64
        assert n == 4 or (n - 1) * set_bytes < 3 * l2        # no more sets than needed
    assert benchlib.num_sets_for(1 << 20, l2_bytes=1 << 20, minimum=2) == 3
    with pytest.raises(ValueError):
        benchlib.num_sets_for(0)


def test_env_line_names_the_machine_and_versions():
    line = benchlib.env_line()
    parts = line.split(" | ")
    assert parts[0].endswith(" UTC") and len(parts[0]) == len("2026-11-30 14:02 UTC")
    assert parts[2] == f"torch {torch.__version__}" and parts[3].startswith("numba ")
    assert parts[4].startswith("numba-cuda ")
    if not torch.cuda.is_available():
        assert parts[1].endswith(f"({torch.get_num_threads()} threads)")


def test_indexed_calls_pass_the_index_only_to_functions_that_take_it():
    seen = []
    benchlib._indexed(lambda i: seen.append(i))(3)
    benchlib._indexed(lambda: seen.append("no index"))(4)
    assert seen == [3, "no index"]
    assert benchlib.host_time_us(lambda i: seen.append(i), calls=5, warmup=2) > 0
    assert seen[2:] == [0, 1, 0, 1, 2, 3, 4]


def test_sum_device_events_splits_kernels_from_copies():
    from types import SimpleNamespace
    from torch.autograd import DeviceType

    def ev(name, us, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("gemm", 10.0), ev("gemm", 12.5), ev("rmsnorm", 2.0), ev("Memcpy HtoD", 1.0),
              ev("aten::mm", 50.0, DeviceType.CPU)]
    got = benchlib.sum_device_events(events)
    assert got == {"kernels": {"gemm": {"count": 2, "us": 22.5}, "rmsnorm": {"count": 1, "us": 2.0}},
                   "memcpy": {"Memcpy HtoD": {"count": 1, "us": 1.0}}}


def test_nano_vllm_workload_matches_its_draw_order():
    import random

    prompts, out_lens = benchlib.nano_vllm_workload(8)
    random.seed(0)                                  # nano-vllm's bench.py, drawn the same way
    expected = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(8)]
    assert prompts == expected and out_lens == [random.randint(100, 1024) for _ in range(8)]


def test_random_checkpoint_loads_in_both_loaders_and_is_reused(tmp_path):
    import transformers
    from safetensors.torch import load_file

    from pagedattn.models.loader import load_model

    path = benchlib.random_checkpoint(TINY_SHAPES, cache_dir=str(tmp_path), dtype=torch.float32,
                                      shard_bytes=200_000, device="cpu")
    shards = sorted(Path(path).glob("*.safetensors"))
    assert len(shards) > 1 and shards[-1].name.endswith(f"-of-{len(shards):05d}.safetensors")
    written = {name: t for shard in shards for name, t in load_file(shard).items()}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert set(written) == set(theirs)                  # HF's names and shapes, nothing missing or extra
    for name, t in written.items():
        assert torch.equal(t, theirs[name]), name
    load_model(path)                                    # and our loader accepts it
    assert abs(written["model.embed_tokens.weight"].std().item() - 96 ** -0.5) < 0.01      # N(0, 1/fan_in)
    assert abs(written["lm_head.weight"].std().item() - 4 * 96 ** -0.5) < 0.04
    assert benchlib.random_checkpoint(TINY_SHAPES, cache_dir=str(tmp_path), dtype=torch.float32,
                                      device="cpu") == path
    assert torch.equal(benchlib.random_weight("lm_head.weight", (4, 8), 0), benchlib.random_weight("lm_head.weight", (4, 8), 0))
    assert not torch.equal(benchlib.random_weight("lm_head.weight", (4, 8), 0), benchlib.random_weight("lm_head.weight", (4, 8), 1))


def test_save_plot_writes_a_png(tmp_path):
    path = benchlib.save_plot(str(tmp_path / "p.png"), ["workload", "batch 1"], {"greedy": [2e4, 330.0],
                              "sampled": [1.9e4, None]}, "", "tok/s", "t", logy=True, kind="bar")
    assert Path(path).read_bytes()[:4] == b"\x89PNG"


# ---- scripts/tp_layer_diff.py -------------------------------------------------------------------
from scripts import tp_layer_diff  # noqa: E402


def test_tp_layer_diff_plan_chunks_prompts_then_decodes():
    plan = tp_layer_diff.make_plan([1, 17, 40], decode_steps=2, chunk=16)
    assert plan == [[(0, 0, 1, True), (1, 0, 16, True), (2, 0, 16, True)],
                    [(1, 16, 1, True), (2, 16, 16, True)],
                    [(2, 32, 8, True)],
                    [(0, 1, 1, False), (1, 17, 1, False), (2, 40, 1, False)],
                    [(0, 2, 1, False), (1, 18, 1, False), (2, 41, 1, False)]]
    assert tp_layer_diff.make_plan([5, 3], 0) == [[(0, 0, 5, True), (1, 0, 3, True)]]


def test_tp_layer_diff_compare_names_the_first_site_that_leaves_the_noise():
    torch.manual_seed(0)
    ref = [{s: torch.randn(4, 8, dtype=torch.float64) for s in ("L00 attn", "L00 out", "L01 attn")}]
    tp1 = [{s: t + 1e-3 * torch.randn_like(t) for s, t in ref[0].items()}]
    tp2 = [{s: t + 2e-3 * torch.randn_like(t) for s, t in ref[0].items()}]
    clean = tp_layer_diff.compare(ref, tp1, tp2, torch.float16, ["prefill"])
    assert not any(r["jump"] for r in clean)
    tp2[0]["L00 out"] = tp2[0]["L00 out"].clone()
    tp2[0]["L00 out"][2] *= 1.5                         # one token of one site goes wrong
    tp2[0]["L01 attn"] = torch.full_like(ref[0]["L01 attn"], float("nan"))
    rows = tp_layer_diff.compare(ref, tp1, tp2, torch.float16, ["prefill"])
    assert [r["site"] for r in rows if r["jump"]] == ["L00 out", "L01 attn"]
    assert rows[2]["tp2_vs_ref"] == float("inf")
    summary = tp_layer_diff.summarize(rows, ["L00 attn", "L00 out", "L01 attn"])
    assert [s["jump"] for s in summary] == [False, True, True]


def test_tp_layer_diff_on_two_cpu_ranks_finds_no_jump(tmp_path):
    # float32 over gloo against a float64 reference: TP=2 differs from TP=1 only by the all-reduce's
    # summation order, so every site stays within 4x TP=1's own float32 error (measured ratios ~1.0-1.2)
    path = benchlib.random_checkpoint(TINY_SHAPES, cache_dir=str(tmp_path), dtype=torch.float32, device="cpu")
    res = tp_layer_diff.main(device="cpu", model=path, prompt_lens=(1, 17, 40), decode_steps=2, chunk=16,
                             block_size=8, out=str(tmp_path / "out"), timeout_s=120)
    assert res["first_jump"] is None, res["first_jump"]
    assert [s["site"] for s in res["sites"]] == tp_layer_diff.site_names(2)
    assert len(res["rows"]) == 5 * 8                    # 3 prefill chunks + 2 decode steps, 8 sites each
    assert max(r["tp2_vs_ref"] for r in res["rows"]) < 1e-5
    assert all(a["tp2_eq_tp1"] == a["chunks"] for a in res["argmax"])
    md = (tmp_path / "out" / "tp_layer_diff.md").read_text()
    assert "No jump" in md and "| L01 mlp |" in md


# ---- scripts/bench_throughput.py and scripts/profile_step.py: their logic on CPU, tiny random model ----
import random  # noqa: E402

from scripts import bench_throughput, graph_eager_tokens, profile_step  # noqa: E402

ENGINE = dict(max_num_seqs=8, max_model_len=256, num_blocks=96, block_size=8)


@pytest.fixture(scope="module")
def tiny_random(tmp_path_factory):
    return benchlib.random_checkpoint(TINY_SHAPES, cache_dir=str(tmp_path_factory.mktemp("ckpt")),
                                      dtype=torch.float32, device="cpu")


def tiny_workload(n=5, seed=0):
    rng = random.Random(seed)
    return ([[rng.randrange(128) for _ in range(rng.randint(3, 30))] for _ in range(n)],
            [rng.randint(4, 12) for _ in range(n)])


def test_workload_mode_measures_every_kind_and_writes_its_table(tiny_random, tmp_path):
    res = bench_throughput.workload_mode(str(tmp_path), tiny_random, "cpu", engine_kw=ENGINE,
                                         workload=tiny_workload(), batch1=(40, 10))
    assert not res["meta"]["errors"], res["meta"]["errors"]
    rows = {(r["group"], r["params"]): r for r in res["rows"]}
    assert set(rows) == {("workload", k) for k in bench_throughput.PARAM_KINDS} | {
        ("batch 1", k) for k in bench_throughput.BATCH1_KINDS}
    wanted = sum(tiny_workload()[1])
    for (group, kind), r in rows.items():
        assert r["finished"] == r["requests"] and not r["timed_out"]
        assert r["output_tokens"] == (wanted if group == "workload" else 10), (group, kind)
        assert r["tok_s"] > 0 and r["vs_greedy"] == pytest.approx(r["tok_s"] / rows[(group, "greedy")]["tok_s"])
    assert rows[("workload", "greedy")]["vs_greedy"] == 1.0
    md = (tmp_path / "bench_throughput.md").read_text().splitlines()
    assert md[0] == json.loads((tmp_path / "bench_throughput.json").read_text())["meta"]["env"]
    assert any(line.startswith("| batch 1 | sampled seeded | 1 | 1 | 10 |") for line in md)
    assert (tmp_path / "bench_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_run_requests_stops_at_the_time_limit_and_leaves_the_engine_empty(tiny_random):
    from pagedattn import LLM

    llm = LLM(tiny_random, device="cpu", **ENGINE)
    prompts, _ = tiny_workload(3)
    params = [bench_throughput.sampling_params("greedy", 60, i) for i in range(3)]
    r = bench_throughput.run_requests(llm, prompts, params, time_limit=0.0, tag="t")
    assert r["timed_out"] and r["finished"] == 0 and r["token_ids"] == [None] * 3
    assert r["output_tokens"] == llm.metrics()["num_generated_tokens"] and not llm.engine.has_unfinished_requests()
    full = bench_throughput.run_requests(llm, prompts, params, time_limit=60.0, tag="u")
    assert full["finished"] == 3 and full["output_tokens"] == 180 and all(len(t) == 60 for t in full["token_ids"])


def test_batch1_request_fits_the_model_and_its_vocabulary():
    prompt, n = bench_throughput.batch1_request(2048, 151936)
    assert len(prompt) == 512 and n == 256 and max(prompt) <= 10000
    prompt, n = bench_throughput.batch1_request(256, 128)
    assert len(prompt) + n <= 256 and len(prompt) == 170 and max(prompt) < 128
    assert bench_throughput.batch1_request(256, 128) == (prompt, n)              # seeded: the same request


def test_compare_greedy_counts_identical_requests_and_first_divergences():
    base = [[1, 2, 3], [4, 5, 6], [7, 8], None]
    other = [[1, 2, 3], [4, 9, 6], [7, 8, 9], [1]]
    assert bench_throughput.compare_greedy(base, other) == dict(compared=3, identical=1, first_divergence=[1, 2])
    assert bench_throughput.first_divergence([1, 2, 3], [1, 2, 4]) == 2


def test_tp_mode_compares_tp2_with_tp1_on_two_cpu_ranks(tiny_random, tmp_path):
    prompts, lens = tiny_workload(4)
    res = bench_throughput.tp_mode(str(tmp_path), 0, 60.0, 8, 256, ckpt=tiny_random, device="cpu",
                                   workload=(prompts, lens), batch1=(40, 10))
    assert not res["errors"], res["errors"]
    assert set(res["tp"]) == {"tp1_eager", "tp2_eager"}                 # graphs: CUDA only
    assert all(r["finished"] == 4 and r["batch1_tok_s"] > 0 and not r["graphs"] for r in res["tp"].values())
    assert res["greedy"] == {"compared": 4, "identical": 4, "first_divergence": []}   # float32: no near-ties
    assert res["speedup_eager"] > 0 and res["batch1_speedup_eager"] > 0
    table = (tmp_path / "bench_tp.md").read_text()
    assert "| tp2_eager | no |" in table and "Greedy ids identical for 4 of 4" in table
    assert (tmp_path / "bench_tp.png").read_bytes()[:4] == b"\x89PNG"


def test_hf_mode_runs_hf_beside_the_engine_numbers(tiny_random, tmp_path):
    benchlib.save(str(tmp_path), "bench_throughput", [dict(group="batch 1", params="greedy", tok_s=100.0)], {})
    res = bench_throughput.hf_mode(str(tmp_path), tiny_random, "cpu", hf_requests=0, batch1_tokens=6,
                                   max_model_len=64, workload=tiny_workload())
    assert not res["meta"]["errors"], res["meta"]["errors"]
    greedy, sampled = res["rows"]
    assert (greedy["params"], sampled["params"]) == ("greedy", "sampled seeded")
    assert greedy["output_tokens"] == 6 and greedy["engine_vs_hf"] == pytest.approx(100.0 / greedy["tok_s"])
    assert sampled["engine_tok_s"] is None
    assert "| batch 1 | greedy | HF generate | 6 |" in (tmp_path / "bench_hf.md").read_text()
    assert (tmp_path / "bench_hf.png").read_bytes()[:4] == b"\x89PNG"


def test_profile_step_rows_and_memory_floor(tiny_random, tmp_path):
    res = profile_step.main(str(tmp_path), batches=(1, 3), model=tiny_random, device="cpu", prompt_len=12, steps=2,
                            profile_steps=1, prefill_seqs=2, prefill_len=20, sampled=True, max_model_len=256,
                            engine_kw=dict(num_blocks=96, block_size=8))
    steps = [(r["step"], r["batch"]) for r in res["rows"]]
    assert steps == [("prefill", 2), ("decode", 1), ("decode", 3), ("decode sampled", 1), ("decode sampled", 3)]
    assert all(r["wall_ms"] > 0 and r["tok_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["prefill_tokens"] == 2 * 20                             # one step prefilled both
    assert "| decode sampled | 3 |" in (tmp_path / "profile_step.md").read_text()
    from pagedattn.models.loader import read_config

    cfg = read_config(tiny_random)                      # 2 layers, hidden 96, 6/2 heads of 16, I 160, V 128
    per_layer = 96 * (96 + 64) + (96 + 64) + 96 * 96 + 3 * 96 * 160 + 2 * 96
    assert profile_step.weight_bytes_per_step(cfg, 3, 2) == 2 * (2 * per_layer + 96 + 128 * 96 + 3 * 96)
    assert profile_step.kv_bytes_per_step(cfg, [10, 30], 2) == 2 * 2 * 2 * 2 * 16 * 40


# ---- scripts/memory_sharing.py ------------------------------------------------------------------
def test_memory_sharing_counts_shared_blocks(tiny_random, tmp_path):
    from scripts import memory_sharing

    prompts = [[(7 * i + j) % 120 + 3 for j in range(40)] for i in range(2)]     # 3 blocks of 16 tokens each
    rows = memory_sharing.main(tiny_random, max_tokens=6, widths=(2,), beam_width=2, out=str(tmp_path),
                               prompts=prompts)
    sampling, beam = rows
    assert (sampling["kind"], sampling["width"], beam["kind"], beam["width"]) == (
        "parallel sampling", 2, "beam search", 2)
    for r in rows:                                     # forks share the prompt's blocks: physical < logical
        assert 0 < r["peak_physical_blocks"] < r["peak_logical_blocks"] and 0 < r["saving_at_peak"] < 1
    assert "| parallel sampling | 2 |" in (tmp_path / "memory_sharing.md").read_text()


# ---- scripts/profile_ttft.py and scripts/profile_core.py on CPU, tiny random model ----
from scripts import profile_core, profile_ttft  # noqa: E402


def test_profile_ttft_rows_follow_the_workload_step_by_step(tiny_random):
    """Every prompt token is scheduled once (no prefix cache), first tokens only grow and reach every request,
    a TTFT per request, a full run's tok/s; the engine is left empty."""
    from pagedattn import LLM

    prompts, out_lens = tiny_workload(6)
    llm = LLM(tiny_random, device="cpu", enable_prefix_caching=False, max_num_batched_tokens=32, **ENGINE)
    rows, ttfts, tok_s = profile_ttft.run(llm, prompts, out_lens, "t", max_steps=100, full=True)
    assert sum(r["prompt_tokens"] for r in rows) == sum(map(len, prompts))
    firsts = [r["first_tokens"] for r in rows]
    assert firsts == sorted(firsts) and firsts[-1] == len(prompts) and firsts[0] < len(prompts)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(ttfts) == len(prompts) and all(t > 0 for t in ttfts) and tok_s > 0
    assert not llm.engine.has_unfinished_requests()
    rows, ttfts, tok_s = profile_ttft.run(llm, prompts, out_lens, "u", max_steps=100)    # stops at the last first token
    assert rows[-1]["first_tokens"] == len(prompts) and tok_s is None
    assert not llm.engine.has_unfinished_requests()
    llm.close()


def test_graph_eager_tokens_on_the_cpu_finds_the_paths_equal(tiny_random):
    """On the CPU every path is eager: one row per path and request, each the eager path's tokens."""
    rows = graph_eager_tokens.run(tiny_random, "cpu", [20, 33], 6, 64, 128, engine_kw=dict(num_blocks=32))
    assert [(r["path"], r["prompt_len"]) for r in rows] == [(p, n) for p in graph_eager_tokens.PATHS for n in (20, 33)]
    assert all(r["first_difference"] == "none" and r["tokens"] == 6 and not r["graphs"] for r in rows)


def test_profile_core_ways_generate_the_same_tokens(tiny_random):
    """The offline way and the core's streamed way count the same output tokens (every request to its
    max_tokens), and the engine's own output processor is back afterwards."""
    from pagedattn import LLM

    prompts, out_lens = tiny_workload(5)
    llm = LLM(tiny_random, device="cpu", enable_prefix_caching=False, **ENGINE)
    own = llm.engine.outputs
    for way in ("offline", "core"):
        tokens, wall, cpu = profile_core.run_way(llm, prompts, out_lens, way, way)
        assert tokens == sum(out_lens) and wall > 0 and cpu > 0, way
        assert llm.engine.outputs is own and not llm.engine.has_unfinished_requests()
    llm.close()


# ---- scripts/startup_times.py ---------------------------------------------------------------------
def test_startup_times_measure_a_fresh_process(tmp_path):
    """One warm start of a tiny checkpoint on the CPU in a fresh process: the import, LLM() and the first
    token in that order, from the interpreter's start, no error line, the table and the JSON written."""
    from helpers import write_tiny_checkpoint
    from scripts import startup_times

    ckpt = write_tiny_checkpoint(tmp_path / "tiny")
    (row,) = startup_times.main(model=ckpt, device="cpu", dtype="float32", fresh=0, warm=1, out=str(tmp_path / "o"))
    assert "failed" not in row, row
    assert 0 < row["import_s"] < row["llm_s"] < row["first_s"], row
    assert row["error_lines"] == 0 and row["phases"]["load_model"] > 0, row
    assert "| warm | 0 |" in (tmp_path / "o" / "startup_times.md").read_text()
    assert json.loads((tmp_path / "o" / "startup_times.json").read_text())[0]["kind"] == "warm"
