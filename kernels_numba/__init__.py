"""numba.cuda kernels: paged decode attention (the v1 -> v5 journey), prefill, cache ops.

Under NUMBA_ENABLE_CUDASIM=1 (CI, no GPU) the kernels run in numba's CUDA simulator;
importing this package installs the warp shuffles the simulator lacks (see simulator.py).
"""
from kernels_numba import simulator as _simulator

_simulator.install()
