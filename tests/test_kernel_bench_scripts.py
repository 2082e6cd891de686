"""The decode-kernel bench scripts' own logic, on CPU: the problems they build, the checks they run
before timing, the tables they write. (Their timings need the GPU; what they run and check must not
wait for one.) Without a GPU our kernels run in numba's CUDA simulator, so the shapes are tiny."""
import json

import pytest
import torch

from kernels_numba import paged_attention as pa
from scripts import bench_kernels, profile_decode, tune_splits

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the simulator path; the GPU runs the scripts")


@CPU_ONLY
def test_problem_layouts_agree_on_a_ragged_batch():
    # the paged pool (ours), the padded dense cache with its key mask (SDPA) and the fp32 reference
    # describe one attention: each within the benchmark's own check of the reference
    prob = bench_kernels.Problem([20, 48], num_sets=2, device="cpu")
    ref = prob.reference(1)
    bench_kernels.check_close(prob.ours(10, torch.empty_like(prob.q))(1), ref, "v10")
    bench_kernels.check_close(prob.sdpa(1), ref, "sdpa")
    with pytest.raises(AssertionError, match="max err"):
        bench_kernels.check_close(prob.sdpa(0), ref, "sdpa on another set")


@CPU_ONLY
def test_bench_kernels_checks_every_version_before_timing(tmp_path):
    rows = bench_kernels.main(out_dir=tmp_path, versions=[1, 10], check=True, device="cpu",
                              todo=[("1 x 40", [40]), ("ragged 2", [7, 33])])
    assert [r["point"] for r in rows] == ["1 x 40", "ragged 2"]
    assert all(set(r["err"]) == {"v1", "v10", "sdpa"} for r in rows)
    saved = json.loads((tmp_path / "kernels_bench.json").read_text())
    assert saved["meta"]["versions"] == [1, 10] and len(saved["rows"]) == 2
    assert "| point |" in (tmp_path / "kernels_bench.md").read_text()


def test_points_cover_the_grid_the_long_and_the_ragged():
    labels = dict(bench_kernels.points())
    assert len(labels) == len(bench_kernels.BATCHES) * len(bench_kernels.CONTEXTS) + len(bench_kernels.EXTRA_POINTS)
    assert labels["1 x 32768"] == [32768] and labels["3 x 5000"] == [5000] * 3
    ragged = labels["ragged 64"]
    assert len(ragged) == 64 and 100 <= min(ragged) < max(ragged) <= 4000
    assert labels["ragged 8"] == bench_kernels.context_lens("uniform 100-8000")  # seeded: the same every run


def test_bench_table_puts_the_prediction_beside_the_measurement():
    row = dict(point="1 x 8192", kv_mb=4.2, us={"v10": 8.1, "sdpa": 8.8, "flex": 429.0}, predicted_us=8.0,
               gbs={"v10": 518.0}, pct_copy={"v10": 12.3}, vs_sdpa={"v10": 8.8 / 8.1})
    header, _, line = bench_kernels.table([row], [10]).splitlines()
    cells = dict(zip(header.strip("| ").split(" | "), line.strip("| ").split(" | ")))
    assert cells["v10 us"] == "8.1" and cells["v10 predicted us"] == "8" and cells["v10/SDPA"] == "1.09"
    assert cells["v10/flex"] == "53"


def test_tune_plans_cover_the_context_with_whole_chunks_per_warp():
    plans = tune_splits.combos(2048, [1, 4, 16, 64], [4, 8], ["fused", "kernel"], 3)
    assert pa.DecodePlan(1, 2048, 4, 3, "none") in plans and pa.DecodePlan(16, 128, 4, 3, "kernel") in plans
    for plan in plans:
        assert plan.splits * plan.partition >= 2048 > (plan.splits - 1) * plan.partition
        assert plan.partition % (16 * plan.warps) == 0 and (plan.splits == 1) == (plan.merge == "none")
    assert not any(p.warps == 8 and p.splits == 64 for p in plans)  # 32 tokens: < 16 per warp


def test_tune_table_marks_the_fastest_forced_configuration():
    row = dict(batch=8, ctx=2048, plan={"v9": "16 x 4", "v10": "16 x 4 f"},
               us={"sdpa": 8.8, "v9": 13.1, "v10": 9.0, "16 x 4 f": 9.1, "16 x 4 k": 8.6, "4 x 8 f": 11.0})
    table = tune_splits.markdown([row], ["4 x 8 f", "16 x 4 f", "16 x 4 k", "64 x 4 k"])
    header, _, line = table.splitlines()
    cells = dict(zip(header.strip("| ").split(" | "), line.strip("| ").split(" | ")))
    assert cells["16 x 4 k"] == "**8.60**" and cells["16 x 4 f"] == "9.10" and cells["64 x 4 k"] == ""
    assert cells["v10 us (plan)"] == "9.00 (16 x 4 f)"
    assert cells["v10 / SDPA"] == f"{8.8 / 9.0:.2f}" and cells["best / SDPA"] == f"{8.8 / 8.6:.2f}"


@CPU_ONLY
@pytest.mark.slow
def test_tune_sweep_and_profile_check_their_configurations():
    rows = tune_splits.main(["1x64"], [2], [2], ["kernel"], check=True, device="cpu")
    assert rows[0]["plan"]["v10"] and rows[0]["us"] == {}
    err = profile_decode.main(1, 40, "10", plan=(2, 2, "fused"), iters=1, device="cpu")
    assert err <= bench_kernels.TOLERANCE
