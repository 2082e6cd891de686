"""The kernels' own error type, so kernels_numba depends on nothing above it.

pagedattn.errors re-exports KernelLaunchError: `from pagedattn.errors import KernelLaunchError` names this
same class.
"""


class KernelLaunchError(ValueError):
    """Kernel arguments with mismatched shapes, dtypes, devices, or block ids outside the pool."""
