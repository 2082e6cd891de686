"""Load a Hugging Face Qwen2 checkpoint directory into pagedattn's Qwen2ForCausalLM.

Reads config.json and the safetensors files (one file, several, or a sharded
model.safetensors.index.json) with the safetensors library, checks every tensor's name and shape
against the model, and assigns them; HF's own model classes are never used. Every problem is a
ModelLoadError that names the file or tensor at fault.
"""
import glob
import json
import os

import torch
from safetensors import safe_open

from pagedattn.errors import ModelLoadError
from pagedattn.models.qwen2 import Qwen2Config, Qwen2ForCausalLM


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


def load_model(path, device="cpu", dtype=torch.float32, attn_backend="auto"):
    """Build Qwen2ForCausalLM from a HF checkpoint directory.

    path: directory with config.json and *.safetensors. device: "cpu", "cuda", ... dtype: parameter dtype.
    attn_backend: "auto" / "torch" / "numba" or a backend object (see pagedattn.layers.attention.get_backend).
    Returns (model in eval mode on `device`, parameters frozen, Qwen2Config).
    """
    path = os.fspath(path)
    config = read_config(path)
    where = _tensor_files(path)
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = Qwen2ForCausalLM(config, attn_backend)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied lm_head appears once
    by_file = {}
    for name in expected:
        if name not in where:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint in {path!r}")
        by_file.setdefault(where[name], []).append(name)
    state = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ModelLoadError(f"tensor {name!r} in {os.path.basename(file)!r} has shape {shape}, "
                                         f"the config expects {expected[name]}")
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    assert not still_meta, f"parameters left unloaded: {still_meta}"
    return model.eval().requires_grad_(False), config  # inference only: no autograd graphs
