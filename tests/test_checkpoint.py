"""The safetensors loader: sharded checkpoints, dtype/device, and every ModelLoadError it promises."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import PagedRunner, tiny_checkpoint, write_tiny_checkpoint  # noqa: F401 (fixture)
from pagedattn.errors import ModelLoadError
from pagedattn.models.loader import load_model


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint that a test may break."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


def edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_loads_and_matches_all_parameters(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint)
    stored = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(params) == set(stored)
    for name, p in params.items():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), stored[name]), name
    assert config.num_hidden_layers == 2 and not model.training


def test_sharded_checkpoint_equals_single_file(tiny_checkpoint, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    a, config = load_model(path)
    b, _ = load_model(tiny_checkpoint)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    ids = list(range(3, 20))
    la = PagedRunner(a, config, num_blocks=4).step([(0, ids)], num_prefills=1)
    lb = PagedRunner(b, config, num_blocks=4).step([(0, ids)], num_prefills=1)
    assert (la - lb).abs().max() < 1e-5


def test_dtype_is_applied(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    with pytest.raises(ModelLoadError, match="config.json.*missing"):
        load_model(ckpt)


@pytest.mark.parametrize("model_type, arch", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_not_qwen2(ckpt, model_type, arch):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type=model_type, architectures=[arch])
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"not a Qwen2 checkpoint: model_type='{model_type}'"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ModelLoadError, match="'model.layers.1.self_attn.k_proj.bias' is missing"):
        load_model(ckpt)


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:100].contiguous()

    edit_tensors(ckpt, shrink)
    with pytest.raises(ModelLoadError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "'model.layers.0.mlp.up_proj.weight'" in msg and "(100, 96)" in msg and "(160, 96)" in msg


def test_no_safetensors(ckpt):
    os.remove(ckpt / "model.safetensors")
    torch.save({}, ckpt / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors files"):
        load_model(ckpt)


def test_missing_shard(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(ModelLoadError, match=f"shard '{shard}'.*missing"):
        load_model(path)
