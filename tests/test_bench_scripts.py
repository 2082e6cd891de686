"""The GPU benchmark scripts' own logic, on CPU: the problem they build, the calls they time, the
tables they write. (Their timings need the GPU; what they run and check must not wait for one.)"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_kernels  # noqa: E402
import tune_splits  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the simulator path; the GPU runs the scripts themselves")
@pytest.mark.parametrize("version", [8, 9])
def test_problem_layouts_agree(version):
    # the paged pool (ours), the dense cache (SDPA) and the fp32 reference describe one attention:
    # each within the benchmark's own 4e-3 check of the reference
    prob = bench_kernels.Problem(2, 48, num_sets=2, want_flex=False, device="cpu")
    ref = prob.reference(1)
    got = prob.ours(version, torch.empty_like(prob.q))(1)
    bench_kernels._check(got, ref, f"v{version}")
    bench_kernels._check(prob.sdpa(1), ref, "sdpa")
    with pytest.raises(AssertionError, match="max err"):
        bench_kernels._check(prob.sdpa(0), ref, "sdpa on another set")


def test_num_sets_exceed_l2():
    for batch, ctx in [(1, 512), (64, 2048), (256, 8192)]:
        n = bench_kernels.Problem.num_sets_for(batch, ctx)
        set_bytes = 2 * batch * ctx * bench_kernels.NUM_KV_HEADS * bench_kernels.HEAD_DIM * 2
        assert 4 <= n <= 64 and (n * set_bytes >= 3 * bench_kernels.L2_BYTES or n == 64)


def test_tune_table_marks_the_fastest_forced_configuration():
    row = dict(batch=64, ctx=2048, plan={"v8": 4, "v9": "1 x 8"},
               us={"sdpa": 21.0, "v8": 27.0, "v9": 23.5, "s1_w8_st3": 23.2, "s2_w4_st3": 26.4})
    table = tune_splits.markdown([row], [1, 2], [4, 8], [3])
    header, _, line = table.splitlines()
    assert header.split(" | ")[4:8] == ["1 x 4", "1 x 8", "2 x 4", "2 x 8"]
    cells = line.strip("| ").split(" | ")
    assert cells[4:8] == ["", "**23.20**", "26.40", ""]
    assert cells[-2:] == [f"{21.0 / 23.5:.2f}", f"{21.0 / 23.2:.2f}"]


# ---- scripts/benchlib.py ------------------------------------------------------------------------
from scripts import benchlib  # noqa: E402

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
    from pagedattn.models.loader import load_model

    path = benchlib.random_checkpoint(TINY_SHAPES, cache_dir=str(tmp_path), dtype=torch.float32,
                                      shard_bytes=200_000, device="cpu")
    shards = sorted(p.name for p in Path(path).glob("*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    ours, _ = load_model(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    emb = ours.model.embed_tokens.weight
    assert abs(emb.std().item() - 96 ** -0.5) < 0.01                  # N(0, 1/fan_in)
    assert abs(ours.lm_head.weight.std().item() - 4 * 96 ** -0.5) < 0.04
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
