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


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
