"""scripts/bench_serving.py --smoke on CPU: the offline run, the server as a subprocess
(`python -m pagedattn serve`), Poisson and all-at-once rates, and the files it writes. Timings on a
shared CPU mean nothing; what must hold is that every request completed whole and the pool was freed."""
import json
import math

import pytest

from scripts import bench_serving


def test_arrival_times_are_poisson_and_seeded():
    times = bench_serving.arrival_times(4000, 50.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times == sorted(times) and times[0] == 0.0
    assert abs(sum(gaps) / len(gaps) - 1 / 50) < 0.1 / 50          # mean gap 1/rate (4000 draws: ~1.6% s.e.)
    assert times == bench_serving.arrival_times(4000, 50.0, seed=1)
    assert bench_serving.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


@pytest.mark.slow                   # three processes start (the offline LLM, two servers): ~20-30 s of CPU
def test_smoke_run(tmp_path):
    rows = bench_serving.main(str(tmp_path), smoke=True)
    served = [r for r in rows if r["rate"] != "offline"]
    assert [(r["rate"], r.get("stream_interval")) for r in rows] == [(8.0, 1), ("inf", 1), ("inf", 4),
                                                                     ("offline", None)]
    for r in served:
        assert r["failed"] == 0 and r["requests"] == 12
        assert r["kv_blocks_free_after"] == "64/64"
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["itl_p50_ms"] > 0 and r["e2e_p50_ms"] >= r["ttft_p50_ms"]
        assert r["served_over_offline"] > 0
    data = json.loads((tmp_path / "bench_serving.json").read_text())
    assert data["meta"]["total_output_tokens"] == sum(bench_serving.workload(12, 4, 24, 512)[1])
    assert data["meta"]["failures"] == {}
    for name in ("bench_serving.md", "bench_serving.png", "bench_serving_latency.png",
                 "server_stream_interval_1.log", "server_stream_interval_4.log"):
        assert (tmp_path / name).stat().st_size > 0
