"""Load a Hugging Face Qwen2 checkpoint directory into pagedattn's Qwen2ForCausalLM (or one rank's shard).

Reads config.json and the safetensors files (one file, several, or a sharded
model.safetensors.index.json) with the safetensors library and checks every tensor's name and shape
against the config; HF's own model classes are never used. Every problem is a ModelLoadError that names
the file or tensor at fault.

The checkpoint stays in HF's layout; the model's layout differs in two ways, resolved tensor by tensor:

    q_proj, k_proj, v_proj (weight, bias)  ->  rows of self_attn.qkv_proj   (packed_modules_mapping)
    gate_proj, up_proj                     ->  rows of mlp.gate_up_proj
    every column/row/vocab-parallel layer  ->  only rank tp_rank's slice (pagedattn/layers/linear.py)

Each checkpoint tensor is opened as a safetensors slice and handed to its layer's `weight_loader`, which
reads only the rows (or columns) its rank keeps, so a rank never holds more than its shard.

`load_gguf_model(path, gguf_file)` builds the same model from a GGUF file (config and tokenizer from the
directory `path`) without a float32 copy: every quantized matrix stays as its memory-mapped blocks, a
QuantWeight in place of the layer's Parameter (q/k/v and gate/up as the parts of their fused layer, in
output order), and the ops table reads them (pagedattn/layers/ops.py: quantize_ops). Norms and biases
(F32 in the file) load as above. CPU, float32 activations, one rank.
"""
import contextlib
import glob
import json
import os

import torch
from safetensors import safe_open

from pagedattn.errors import ModelLoadError
from pagedattn.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, checkpoint_shapes


def read_config(path):
    """Qwen2Config from <path>/config.json."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelLoadError(f"{config_file!r} is missing: not a Hugging Face checkpoint directory")
    try:
        with open(config_file) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_file!r}: {e}") from e
    return Qwen2Config.from_dict(d)


def _tensor_files(path):
    """{tensor name: safetensors file} from the shard index, or from every *.safetensors in path."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        for name in set(weight_map.values()):
            if not os.path.isfile(os.path.join(path, name)):
                raise ModelLoadError(f"shard {name!r} listed in {index!r} is missing")
        return {t: os.path.join(path, f) for t, f in weight_map.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {path!r} (only safetensors checkpoints are supported)")
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where[name] = file
    return where


def _target(model, name):
    """Checkpoint tensor name -> (owning module, its parameter, shard id or None)."""
    module_path, _, leaf = name.rpartition(".")                  # e.g. model.layers.0.self_attn.q_proj, weight
    parent, _, proj = module_path.rpartition(".")
    shard = None
    if proj in model.packed_modules_mapping:
        proj, shard = model.packed_modules_mapping[proj]
        module_path = f"{parent}.{proj}"
    module = model.get_submodule(module_path)
    return module, getattr(module, leaf), shard


def load_weights(model, tensors):
    """Fill model's parameters from checkpoint tensors, rank slices only.

    model: Qwen2ForCausalLM (any tp_rank / tp_size). tensors: {HF tensor name: torch tensor or safetensors
    slice} with every name of checkpoint_shapes(model.config), of those shapes (checked by the caller).
    """
    for name, loaded in tensors.items():
        module, param, shard = _target(model, name)
        loader = getattr(module, "weight_loader", None)
        if loader is None:                                       # norms: the whole tensor on every rank
            param.data.copy_(loaded[:])
        elif shard is None:
            loader(param, loaded)
        else:
            loader(param, loaded, shard)


@contextlib.contextmanager
def _default_dtype(dtype):
    """Parameters are created in `dtype` (torch.empty: no initialisation, filled by the loader)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config, device="cpu", dtype=torch.float32, attn_backend="auto", tp_rank=0, tp_size=1,
                weights="float32", fused_allreduce="auto"):
    """An unloaded Qwen2ForCausalLM (rank tp_rank of tp_size) with uninitialised parameters on `device`;
    weights: "float32" (tensors) or "quantized" (its layers will hold GGUF blocks: its ops table says so);
    fused_allreduce: see Qwen2ForCausalLM."""
    with _default_dtype(dtype), torch.device(device):
        return Qwen2ForCausalLM(config, attn_backend, tp_rank, tp_size, weights=weights,
                                fused_allreduce=fused_allreduce)


def load_model(path, device="cpu", dtype=torch.float32, attn_backend="auto", tp_rank=0, tp_size=1,
               fused_allreduce="auto"):
    """Build Qwen2ForCausalLM from a HF checkpoint directory: the whole model, or rank tp_rank's shard.

    path: directory with config.json and *.safetensors. device: "cpu", "cuda", "cuda:1", ... dtype: parameter
    dtype. attn_backend: "auto" / "torch" / "numba" or a backend object (pagedattn.layers.attention).
    tp_rank, tp_size: tensor-parallel position; the ranks' forwards all-reduce on the default process group,
    so with tp_size > 1 every rank must run each forward together. fused_allreduce: which steps fuse the
    all-reduces with the norms after them (Qwen2ForCausalLM).
    Returns (model in eval mode on `device`, parameters frozen, Qwen2Config).
    """
    from pagedattn.distributed.parallel import check_tensor_parallel_size

    path = os.fspath(path)
    config = read_config(path)
    check_tensor_parallel_size(config, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must lie in [0, tp_size={tp_size})")
    where = _tensor_files(path)
    expected = checkpoint_shapes(config)
    by_file = {}
    for name in expected:
        if name not in where:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint in {path!r}")
        by_file.setdefault(where[name], []).append(name)
    model = build_model(config, device, dtype, attn_backend, tp_rank, tp_size, fused_allreduce=fused_allreduce)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            slices = {name: f.get_slice(name) for name in names}
            for name, sl in slices.items():
                shape = tuple(sl.get_shape())
                if shape != expected[name]:
                    raise ModelLoadError(f"tensor {name!r} in {os.path.basename(file)!r} has shape {shape}, "
                                         f"the config expects {expected[name]}")
            load_weights(model, slices)
    return model.eval().requires_grad_(False), config  # inference only: no autograd graphs


def load_gguf_model(path, gguf_file=None, attn_backend="auto", activations="float32"):
    """Qwen2ForCausalLM on the CPU whose matrices are the GGUF file's blocks (no float32 copy).

    path: directory with config.json (and the tokenizer). gguf_file: the GGUF file (default: the one
    *.gguf in path). attn_backend: as load_model's. activations: "float32" (the dequantized matrices'
    products) or "int8" (x rounded per block of 32, integer products: kernels_numba/cpu_quant_int8.py) for
    every matrix but the embedding table's gather. Every tensor's name and shape is checked against the
    config. Returns (model in eval mode, Qwen2Config); its resident size grows to about the file's as
    the kernels touch the blocks (pagedattn.engine.metrics.model_weight_bytes counts them).
    """
    from pagedattn.models.gguf_weights import QuantWeight, find_gguf, hf_name, read_gguf

    path = os.fspath(path)
    config = read_config(path)
    gguf_file = gguf_file or find_gguf(path)
    if gguf_file is None:
        raise ModelLoadError(f"no GGUF file for {path!r}: put one *.gguf file in the directory")
    tensors = {hf_name(name): t for name, t in read_gguf(gguf_file).items()}
    expected = checkpoint_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelLoadError(f"tensor {name!r} is missing from {gguf_file!r}")
        if tensors[name].shape != shape:
            raise ModelLoadError(f"tensor {name!r} in {gguf_file!r} has shape {tensors[name].shape}, "
                                 f"the config expects {shape}")
    # Parameters come from torch.empty: the float32 matrices are never written, so never made resident.
    model = build_model(config, "cpu", torch.float32, attn_backend, weights="quantized")
    plain, fused = {}, {}                        # fused: module -> {shard id: GGUFTensor}
    for name in expected:
        t = tensors[name]
        if not t.quantized:
            plain[name] = torch.from_numpy(t.data)                   # norms, biases (float32)
            continue
        module, param, shard = _target(model, name)
        if param is not getattr(module, "weight", None):
            raise ModelLoadError(f"tensor {name!r} is {t.fmt}: only weight matrices may be quantized")
        fused.setdefault(module, {})[shard] = t
    load_weights(model, plain)
    order = {"q": 0, "k": 1, "v": 2}
    for module, parts in fused.items():
        weight = QuantWeight([parts[s] for s in sorted(parts, key=lambda s: order.get(s, s or 0))], activations)
        if weight.shape != tuple(module.weight.shape):
            raise ModelLoadError(f"GGUF parts {weight} do not fill {tuple(module.weight.shape)}")
        tied = config.tie_word_embeddings and module is model.model.embed_tokens
        del module.weight                        # the unused float32 Parameter
        module.weight = weight
        if tied:
            del model.lm_head.weight
            model.lm_head.weight = weight
    return model.eval().requires_grad_(False), config
