"""kernels_numba.cpu_linear (the CPU decode step's GEMMs at 4-16 rows) against a float64 numpy reference.

Tolerance: a float32 dot product of length K in any summation order is within K * u * sum_k |x_k w_k|
of the exact value (u = 2^-24, the standard bound for recursive summation); the kernel and torch's
F.linear both are, and the test checks both against it, element by element. The bound holds whatever
order numba's vectoriser picks for the host CPU; how close a single element comes to it does not, so the
"typical error" check is a median over the output, never a fraction of a few dozen elements.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels_numba import cpu_linear
from pagedattn.errors import KernelLaunchError

U = 2.0 ** -24


def reference(x, w, b=None):
    y = x.double().numpy() @ w.double().numpy().T
    return y + b.double().numpy() if b is not None else y


def bound(x, w, b=None):
    K = x.shape[1]
    mag = np.abs(x.double().numpy()) @ np.abs(w.double().numpy()).T
    return (K + 1) * U * (mag + (np.abs(b.double().numpy()) if b is not None else 0)) + 1e-30


# rows: every leftover count of the 4-row groups and both ends of the kernel's range; features: every
# N % 4 (the one-dot-product tail); odd K (no vector-width multiple)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 11, 16, 17])
@pytest.mark.parametrize("N, K", [(64, 896), (67, 33), (130, 4864), (5, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(M, N, K, with_bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    b = torch.randn(N, generator=g) if with_bias else None
    y = cpu_linear.linear(x, w, b, num_threads=2)
    assert y.shape == (M, N) and y.dtype == torch.float32
    ref, tol = reference(x, w, b), bound(x, w, b)
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst err/bound {(err / tol).max():.2f}"
    torch_err = np.abs(F.linear(x, w, b).double().numpy() - ref)
    assert (torch_err <= tol).all()              # the bound holds for torch too: it is not a loose one
    # ... and typical errors sit well inside it: the median of err / bound is 0.03-0.07 here under
    # NUMBA_CPU_NAME=generic, x86-64-v2, znver3, znver4 and skylake-avx512 (torch's: 0.02-0.09), so 0.25 is
    # a 4x margin; a median needs enough elements to be a statistic, which a 1 x 5 output is not.
    if err.size >= 32:
        assert np.median(err / tol) < 0.25, f"median err/bound {np.median(err / tol):.3f}"


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_threads_give_identical_bits(threads):
    """Every thread's range starts at a multiple of 4 weight rows, so each output is summed by the same
    code in the same order whatever the thread count."""
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(6, 200, generator=g), torch.randn(1027, 200, generator=g), torch.randn(1027, generator=g)
    one = cpu_linear.linear(x, w, b, num_threads=1)
    assert torch.equal(cpu_linear.linear(x, w, b, num_threads=threads), one)


def test_nan_and_inf_propagate_to_their_rows_only():
    x = torch.randn(8, 64)
    w = torch.randn(32, 64)
    x[2, 5] = float("nan")
    x[6, 0] = float("inf")
    y = cpu_linear.linear(x, w)
    assert torch.isnan(y[2]).all() and not torch.isfinite(y[6]).any()
    keep = [0, 1, 3, 4, 5, 7]
    assert torch.isfinite(y[keep]).all()
    assert torch.allclose(y[keep], F.linear(x[keep], w), rtol=1e-5, atol=1e-4)


def test_views_and_numpy_inputs():
    """A non-contiguous x (a column slice) is copied to a C array; numpy arrays are taken as they are."""
    base = torch.randn(5, 80)
    x = base[:, 10:74]
    w = torch.randn(40, 64)
    assert torch.allclose(cpu_linear.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch.allclose(cpu_linear.linear(x.numpy(), w.numpy()), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, field", [
    ((torch.randn(4, 8, dtype=torch.float64), torch.randn(16, 8)), "x"),
    ((torch.randn(4, 8), torch.randn(16, 8, dtype=torch.float16)), "weight"),
    ((torch.randn(4, 8), torch.randn(16, 9)), "weight"),
    ((torch.randn(4, 8), torch.randn(16, 8), torch.randn(15)), "bias"),
    ((torch.randn(4, 8, 1), torch.randn(16, 8)), "x"),
    ((torch.randn(4, 8), torch.randn(16, 8), torch.randn(16, 1)), "bias"),
])
def test_bad_arguments_name_the_field(args, field):
    with pytest.raises(KernelLaunchError, match=f"^{field}:"):
        cpu_linear.linear(*args)


def test_use_kernel_takes_small_float32_cpu_calls():
    w = torch.empty(64, 896)
    assert cpu_linear.use_kernel(torch.empty(1, 896), w)
    assert cpu_linear.use_kernel(torch.empty(cpu_linear.MAX_ROWS, 896), w)
    assert not cpu_linear.use_kernel(torch.empty(cpu_linear.MAX_ROWS + 1, 896), w)     # prefill: torch
    assert not cpu_linear.use_kernel(torch.empty(8, 896, dtype=torch.float16), w.half())
    assert not cpu_linear.use_kernel(torch.empty(2, 8, 896), w)


def test_small_steps_run_through_the_kernel(monkeypatch):
    """CpuStep.scope (the CPU ops' step scope): inside a small step's scope the GEMMs go to the kernel on
    torch's former thread count and torch runs on one thread; a large step, and any call outside a scope,
    stay with torch; the thread count comes back (after an exception too); nested scopes change nothing."""
    from pagedattn.layers.cpu import CpuStep

    calls, kernel = [], cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a, **k: calls.append(k["num_threads"]) or kernel(*a, **k))
    step, threads = CpuStep(), torch.get_num_threads()
    x, w, b = torch.randn(5, 64), torch.randn(96, 64), torch.randn(96)
    assert torch.allclose(step.linear(x, w, b), F.linear(x, w, b)) and calls == []
    with step.scope(5):
        assert torch.get_num_threads() == 1 and step.threads() == threads
        with step.scope(3):
            assert step.threads() == threads
        y = step.linear(x, w, b)
        assert torch.get_num_threads() == 1
    assert calls == [threads] and torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.get_num_threads() == threads
    with step.scope(cpu_linear.MAX_ROWS + 1):
        assert torch.get_num_threads() == threads
        step.linear(torch.randn(cpu_linear.MAX_ROWS + 1, 64), w)
    assert calls == [threads]
    with pytest.raises(RuntimeError):
        with step.scope(2):
            raise RuntimeError("a failing step")
    assert torch.get_num_threads() == threads and step.threads() == threads
