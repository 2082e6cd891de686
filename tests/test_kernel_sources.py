"""numba's disk cache stamps the package's compiled CPU functions with a digest of all kernels_numba sources
(kernels_numba/sources.py): a callee edited in another file must recompile its callers, never load them
stale. sampling_cpu._exp_total (sampling_cpu.py) calls cpu_attention._exp_inplace (cpu_attention.py): the case."""
import importlib.util
import os
import subprocess
import sys

from numba import njit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys
import numpy as np
import kernels_numba.sources as sources
if sys.argv[1] == "edited":                 # another checkout: any kernels_numba file differs
    sources.source_digest = lambda: "another checkout"
from kernels_numba.sampling_cpu import _exp_total
assert abs(_exp_total(np.zeros(8, np.float32), np.float32(0)) - 8.0) < 1e-6
print(sum(_exp_total.stats.cache_hits.values()), sum(_exp_total.stats.cache_misses.values()))
"""


def _run(cache_dir, version):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT, version], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    hits, misses = map(int, out.stdout.split())
    return hits, misses


def test_an_edit_anywhere_in_the_package_recompiles_its_cached_functions(tmp_path):
    assert _run(tmp_path, "plain") == (0, 1)          # an empty cache: compiled, saved
    assert _run(tmp_path, "plain") == (1, 0)          # the same sources: loaded
    assert _run(tmp_path, "edited") == (0, 1)         # the digest differs: compiled again, not loaded
    assert _run(tmp_path, "plain") == (0, 1)          # and back: the entry was replaced


def test_other_packages_keep_numbas_stamps(tmp_path):
    import kernels_numba.sampling_cpu as sampling_cpu

    mine = type(sampling_cpu._exp_total._cache._impl.locator)
    assert mine.pagedattn_sources and mine.__name__.startswith("Sources")
    assert sampling_cpu._exp_total._cache._impl.locator.get_source_stamp().startswith("kernels_numba ")
    module = tmp_path / "elsewhere.py"
    module.write_text("def f(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("elsewhere", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    other = njit(cache=True)(mod.f)
    assert not getattr(type(other._cache._impl.locator), "pagedattn_sources", False)
