"""A small pool of Python threads for the CPU kernels (kernels_numba.cpu_attention's large calls).

Python threads rather than numba's `prange` for calls made while torch's own threads are busy (a
prefill): they sleep on a lock between calls, where numba's OpenMP threads would spin for milliseconds
on the cores torch's GEMMs need (numba links the system libgomp, torch ships its own). Waking one costs
~0.1 ms, so inside a small step, where torch runs on one thread, the CPU backend uses numba's parallel
loop instead (pagedattn/layers/cpu_attention.py). The kernels release the GIL (`nogil=True`), so the
threads run them at once on disjoint work. Rebuilt after a fork.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numba
from numba.extending import register_jitable

ROWS_PER_THREAD = 64         # a product's threads: at most one per this many output features


class Threads:
    def __init__(self, prefix):
        self.prefix = prefix
        self.executor, self.size, self.pid = None, 0, None

    def run(self, fn, num_threads, args):
        """fn(t, num_threads, *args) for t in 0..num_threads-1; thread 0 in the calling thread."""
        if num_threads <= 1:
            return fn(0, 1, *args)
        if self.executor is None or self.size < num_threads - 1 or self.pid != os.getpid():
            self.executor = ThreadPoolExecutor(max_workers=num_threads - 1, thread_name_prefix=self.prefix)
            self.size, self.pid = num_threads - 1, os.getpid()
        futures = [self.executor.submit(fn, t, num_threads, *args) for t in range(1, num_threads)]
        fn(0, num_threads, *args)
        for f in futures:
            f.result()


@register_jitable
def product_threads(num_threads, num_out):
    """Threads of a product with num_out output features on at most num_threads: the one split every CPU
    product uses, called from Python and from compiled code alike (the fused layer's products must cut
    their rows as the unfused calls do)."""
    return max(1, min(num_threads, num_out // ROWS_PER_THREAD))


def numba_threads(num_threads):
    """Set numba's thread count for this thread's next parallel loop to num_threads (at most numba's pool
    size, at least 1); returns the count set."""
    n = max(1, min(num_threads, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n
