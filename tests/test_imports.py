"""Dependencies point down: kernels import nothing of pagedattn, and the runtime's lower layers import
nothing of the layers above them. Each check imports modules in a fresh interpreter (one for all of a
kind) and lists the modules that came along."""
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import kernels_numba

ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = sorted(f"kernels_numba.{m.name}" for m in pkgutil.iter_modules(kernels_numba.__path__))
# a family's journey (its numbered versions) imports the shipped kernel's entry, never the reverse
JOURNEY_MODULES = [m for m in KERNEL_MODULES if "journey" in m] + [
    "kernels_numba.paged_prefill",  # the prefill journey's first era (v1-v3)
]

# module -> package prefixes it must not load (directly or through anything it imports)
LOWER_LAYERS = {
    "pagedattn": ["pagedattn.engine", "pagedattn.layers", "pagedattn.models", "pagedattn.serving"],
    "pagedattn.errors": ["pagedattn.engine", "pagedattn.layers", "pagedattn.llm"],
    "pagedattn.block_manager": ["pagedattn.engine", "pagedattn.layers", "pagedattn.models"],
    "pagedattn.kv_cache": ["pagedattn.engine", "pagedattn.layers", "pagedattn.models"],
    "pagedattn.layers.cpu": ["pagedattn.engine", "pagedattn.models", "pagedattn.layers.attention"],
    "pagedattn.layers.attention": ["pagedattn.engine", "pagedattn.models"],
    "pagedattn.models.qwen2": ["pagedattn.engine", "pagedattn.serving"],
    "pagedattn.distributed.worker": ["pagedattn.engine", "pagedattn.models", "pagedattn.layers"],
}

# One interpreter loads the third-party packages once, then forks a child per module to import: each child
# starts with no module of this project loaded and reports the project's modules it ended with.
CHILDREN = """
import importlib, json, os, sys
import numba, numpy, torch  # noqa: F401  (loaded once, before the forks)
result = {}
for module in json.loads(sys.argv[1]):
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        importlib.import_module(module)
        ours = sorted(m for m in sys.modules if m.split(".")[0] in ("pagedattn", "kernels_numba"))
        os.write(write, json.dumps(ours).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.wait()
    result[module] = json.loads(text) if text else "import failed"
print(json.dumps(result))
"""


def loaded_by(modules):
    """{module: this project's modules loaded by `import module` in an interpreter that had none}."""
    out = subprocess.run([sys.executable, "-c", CHILDREN, json.dumps(modules)], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_module_is_found():
    assert {"kernels_numba.paged_attention", "kernels_numba.sampling", "kernels_numba.sampling_cpu",
            "kernels_numba.sampling_rule", "kernels_numba.sampling_parts", "kernels_numba.cpu_attention",
            "kernels_numba.errors"} <= set(KERNEL_MODULES)
    assert {"kernels_numba.decode_journey", "kernels_numba.decode_journey_cuda_core", "kernels_numba.prefill_journey",
            "kernels_numba.paged_prefill", "kernels_numba.sampling_journey"} <= set(JOURNEY_MODULES) & set(KERNEL_MODULES)


def test_imports_point_down():
    """Each kernel module loads no pagedattn module and a shipped kernel no journey module; each runtime
    module loads none of the layers above it."""
    loaded = loaded_by(KERNEL_MODULES + list(LOWER_LAYERS))
    forbidden = {**{m: ["pagedattn"] + ([] if m in JOURNEY_MODULES else JOURNEY_MODULES) for m in KERNEL_MODULES},
                 **LOWER_LAYERS}
    wrong = {}
    for module, prefixes in forbidden.items():
        got = loaded[module]
        bad = got if isinstance(got, str) else [m for m in got if any(m == p or m.startswith(p + ".")
                                                                      for p in prefixes)]
        if bad:
            wrong[module] = bad
    assert wrong == {}


# Prints, after each import, whether numba.cuda is loaded: the CPU sampler, the engine's sampler layer and
# bridge (which a CPU engine imports for its caches' owner) must not load it; the CUDA sampler does.
CPU_PATH = """
import sys
import kernels_numba.sampling_cpu, pagedattn.layers.sampler, kernels_numba.bridge
print("numba.cuda" in sys.modules)
import kernels_numba.sampling
print("numba.cuda" in sys.modules)
"""


def test_the_cpu_path_does_not_import_numba_cuda():
    """numba.cuda takes ~0.4 s to import: the CPU path leaves it out (pagedattn.layers.sampler imports the
    CUDA sampler on the first call with CUDA logits, bridge imports numba.cuda in its GPU helpers). Run
    without the simulator, as a CPU engine runs."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", CPU_PATH], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_kernel_error_is_the_runtime_one():
    from kernels_numba.errors import KernelLaunchError as kernel_error
    from pagedattn.errors import KernelLaunchError

    assert KernelLaunchError is kernel_error and issubclass(KernelLaunchError, ValueError)


def test_package_names_load_on_first_use():
    import pagedattn
    from pagedattn.llm import LLM
    from pagedattn.sampling_params import BeamSearchParams, SamplingParams

    assert (pagedattn.LLM, pagedattn.SamplingParams, pagedattn.BeamSearchParams) == (LLM, SamplingParams,
                                                                                      BeamSearchParams)
    try:
        pagedattn.NoSuchName
    except AttributeError:
        pass
    else:
        raise AssertionError("pagedattn.NoSuchName did not raise AttributeError")
