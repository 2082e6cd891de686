"""What the compiled code in numba's disk caches was compiled from: a digest of every kernels_numba/*.py.

numba stamps a cached CPU function with a hash of its own source file only, so a function whose callee
lives in another file (cpu_layer calling cpu_quant's products and cpu_attention's exp, sampling's CPU rows
calling that exp too) would load stale machine code after the callee's file changed, in a checkout being
edited or after an upgrade. install() makes numba stamp every cached function of this package with the
digest of all its sources instead, so an edit anywhere here recompiles the package's CPU kernels once (the
CUDA kernels' keys hold the same digest: bridge.enable_disk_cache). Functions of other packages keep
numba's own stamps.
"""
import functools
import hashlib
import os

from numba.core import caching

FOLDER = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def source_digest():
    """sha256 of every kernels_numba/*.py: what a cached kernel was compiled from."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(FOLDER)):
        if name.endswith(".py"):
            with open(os.path.join(FOLDER, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def _stamped_by_sources(base):
    """numba's locator `base`, for this package's files only, stamping entries with source_digest()."""

    class Locator(base):
        pagedattn_sources = True

        def get_source_stamp(self):
            return "kernels_numba " + source_digest()

        @classmethod
        def from_function(cls, py_func, py_file):
            if os.path.dirname(os.path.abspath(py_file)) != FOLDER:
                return None
            return super().from_function(py_func, py_file)

    Locator.__name__ = Locator.__qualname__ = f"Sources{base.__name__.lstrip('_')}"
    return Locator


def install():
    """Put the package's locators first in numba's list (once; before any cached function is declared)."""
    impl = caching.CacheImpl if hasattr(caching, "CacheImpl") else caching._CacheImpl
    if any(getattr(c, "pagedattn_sources", False) for c in impl._locator_classes):
        return
    # where numba would put the entry: NUMBA_CACHE_DIR, else the package's __pycache__, else the user's cache
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    bases = [getattr(caching, n, None) or getattr(caching, "_" + n) for n in names]
    impl._locator_classes = [_stamped_by_sources(b) for b in bases] + list(impl._locator_classes)
