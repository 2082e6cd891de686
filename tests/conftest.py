"""Test set-up shared by every layer.

Without a CUDA GPU the numba kernels run in numba's CUDA simulator (with the shim in
kernels_numba/simulator.py supplying warp shuffles), so the variable must be set before
numba.cuda is first imported anywhere. Tests marked `gpu` are skipped without a GPU.
"""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N contiguous slices of the selected tests (I from 1); the "
                          "slices of a parametrized test stay together, so parallel shards compile different "
                          "kernel variants (scripts/gpu_suite.sh)")


def shard_slice(num_items, shard):
    """(start, stop) of the I-th of N contiguous, near-equal slices of num_items, for shard = "I/N"."""
    try:
        i, n = (int(v) for v in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard must be I/N with integers, got {shard!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard I/N needs 1 <= I <= N, got {shard!r}")
    return (i - 1) * num_items // n, i * num_items // n


@pytest.hookimpl(trylast=True)         # after `-m` and `-k` have deselected: shards of what actually runs
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard:
        start, stop = shard_slice(len(items), shard)
        config.hook.pytest_deselected(items=items[:start] + items[stop:])
        items[:] = items[start:stop]
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
