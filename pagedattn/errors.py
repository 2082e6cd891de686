"""The project's exception types.

Every error a user can cause is one of these, with a message that names the field and the
allowed range. Value problems subclass ValueError so `except ValueError` keeps working.
"""


class PagedAttnError(Exception):
    """Base class of every error pagedattn raises on purpose."""


class InvalidRequestError(PagedAttnError, ValueError):
    """A prompt or a sampling parameter is out of range; raised before any state changes."""


class ModelLoadError(PagedAttnError, ValueError):
    """A checkpoint is missing a file, is not Qwen2, or has tensors of the wrong shape."""


class KernelLaunchError(PagedAttnError, ValueError):
    """Kernel arguments with mismatched shapes, dtypes, devices, or block ids outside the pool."""


class OutOfBlocksError(PagedAttnError, RuntimeError):
    """The KV pool has too few free blocks; the operation changed nothing."""


class BlockManagerError(PagedAttnError, ValueError):
    """A BlockManager call names an unknown sequence or an argument out of range; nothing changed."""
