"""A small pool of Python threads for the CPU kernels (kernels_numba.cpu_attention's large calls).

Python threads rather than numba's `prange`: they sleep on a lock between calls instead of spinning in a
second OpenMP runtime beside torch's (numba links the system libgomp, torch ships its own), and a kernel
without `parallel=True` compiles in half the time. The kernels release the GIL (`nogil=True`), so the
threads run them at once on disjoint work. Rebuilt after a fork.
"""
import os
from concurrent.futures import ThreadPoolExecutor


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
