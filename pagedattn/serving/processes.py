"""Process plumbing the engine cores and the launcher share: dying with the parent, a name `ps` shows,
signal handlers that are put back, an optional profile, and stopping children in order.

Every serving child starts with "spawn" (torch and CUDA do not survive fork), asks the kernel for SIGTERM
when its parent dies (no orphan keeps a GPU) and ignores SIGINT (a terminal sends Ctrl-C to the whole
process group; the launcher decides the order in which its children stop).
"""
import contextlib
import ctypes
import os
import signal
import sys
import time

now = time.perf_counter


def die_with_parent():
    """Ask Linux to SIGTERM this process when its parent exits (no orphan keeps a GPU); elsewhere a no-op
    (an engine core's idle loop also notices a new parent pid)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)          # PR_SET_PDEATHSIG


def name_process(name):
    """Set this process's name as `ps`, `top` and /proc/PID/comm show it (Linux, 15 bytes); elsewhere a no-op."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, ctypes.create_string_buffer(name.encode()[:15]), 0, 0, 0)      # PR_SET_NAME


@contextlib.contextmanager
def signal_handlers(handlers):
    """Install {signal: handler} for the block and put the previous handlers back after it: a core or a
    profile run in the calling process (a test, a script) leaves that process's signal handling as it was."""
    old = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_profiled(name, fn):
    """fn(), under cProfile when $PAGEDATTN_PROFILE_DIR names a directory: the process's profile goes to
    DIR/<name>.prof when fn returns (a clean stop: SIGTERM to a core, the launcher's shutdown of an API
    server). For studying where a serving process's time goes:
        PAGEDATTN_PROFILE_DIR=/tmp/prof python -m pagedattn serve ...;  python -m pstats /tmp/prof/core0.prof"""
    directory = os.environ.get("PAGEDATTN_PROFILE_DIR")
    if not directory:
        return fn()
    import cProfile

    # A SIGTERM ends fn with SystemExit, so the profile is still written (uvicorn re-raises it); the handler
    # is this call's alone: whatever was there before is back when it returns.
    with signal_handlers({signal.SIGTERM: lambda *_: sys.exit(0)}
                         if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else {}):
        profile = cProfile.Profile()
        try:
            return profile.runcall(fn)
        finally:
            os.makedirs(directory, exist_ok=True)
            profile.dump_stats(os.path.join(directory, f"{name}.prof"))


def stop_processes(procs, timeout=10.0):
    """SIGTERM each live process, wait up to `timeout` in all, SIGKILL what is left, reap everything."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.terminate()
    deadline = now() + timeout
    for p in procs:
        p.join(max(0.0, deadline - now()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
