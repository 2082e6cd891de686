"""The project's exception types.

Every error a user can cause is one of these, with a message that names the field and the
allowed range. Value problems subclass ValueError so `except ValueError` keeps working.
KernelLaunchError belongs to the kernels (kernels_numba.errors, a ValueError), which import nothing of
pagedattn; it is re-exported here, the same class.
"""
from kernels_numba.errors import KernelLaunchError

__all__ = ["PagedAttnError", "InvalidRequestError", "ModelLoadError", "KernelLaunchError", "OutOfBlocksError",
           "BlockManagerError"]


class PagedAttnError(Exception):
    """Base class of every error pagedattn raises on purpose."""


class InvalidRequestError(PagedAttnError, ValueError):
    """A prompt or a sampling parameter is out of range; raised before any state changes."""


class ModelLoadError(PagedAttnError, ValueError):
    """A checkpoint is missing a file, is not Qwen2, or has tensors of the wrong shape."""


class OutOfBlocksError(PagedAttnError, RuntimeError):
    """The KV pool has too few free blocks; the operation changed nothing."""


class BlockManagerError(PagedAttnError, ValueError):
    """A BlockManager call names an unknown sequence or an argument out of range; nothing changed."""
