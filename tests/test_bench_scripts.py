"""The GPU benchmark scripts' own logic, on CPU: the problem they build, the calls they time, the
tables they write. (Their timings need the GPU; what they run and check must not wait for one.)"""
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
