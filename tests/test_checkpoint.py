"""The safetensors loader: merged weights, tensor-parallel shards, sharded checkpoints, dtype/device, and
every ModelLoadError it promises."""
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


def merged_from_checkpoint(stored, config, rank=0, tp_size=1):
    """What rank `rank` of tp_size should hold, sliced here from the HF tensors independently of the
    loader: {parameter name: tensor}. q/k/v rows are sliced by heads, gate/up by rows, o_proj/down_proj
    by columns, the embedding and lm_head by vocab rows."""
    def rows(t):                                    # rank r's 1/tp_size of the rows
        n = t.shape[0] // tp_size
        return t[rank * n:(rank + 1) * n]

    def cols(t):
        n = t.shape[1] // tp_size
        return t[:, rank * n:(rank + 1) * n]

    want = {"model.embed_tokens.weight": rows(stored["model.embed_tokens.weight"]),
            "model.norm.weight": stored["model.norm.weight"], "lm_head.weight": rows(stored["lm_head.weight"])}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            want[p + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                [rows(stored[p + f"self_attn.{x}_proj.{kind}"]) for x in "qkv"])
        want[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(stored[p + "mlp.gate_proj.weight"]),
                                                         rows(stored[p + "mlp.up_proj.weight"])])
        want[p + "self_attn.o_proj.weight"] = cols(stored[p + "self_attn.o_proj.weight"])
        want[p + "mlp.down_proj.weight"] = cols(stored[p + "mlp.down_proj.weight"])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            want[p + f"{norm}.weight"] = stored[p + f"{norm}.weight"]
    return want


def test_loads_and_merges_all_parameters(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint)
    stored = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    params, want = dict(model.named_parameters()), merged_from_checkpoint(stored, config)
    assert set(params) == set(want)
    for name, p in params.items():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), want[name]), name
    assert config.num_hidden_layers == 2 and not model.training


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shard_holds_its_slices(tiny_checkpoint, rank):
    """load_model(tp_rank, tp_size) reads exactly rank r's slices of the checkpoint's tensors."""
    shard, config = load_model(tiny_checkpoint, tp_rank=rank, tp_size=2)
    stored = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    params, want = dict(shard.named_parameters()), merged_from_checkpoint(stored, config, rank, 2)
    assert set(params) == set(want)
    for name, p in params.items():
        assert torch.equal(p.detach(), want[name]), name
    attn = shard.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (3, 1) and shard.lm_head.weight.shape == (64, 96)


def test_merged_projections_equal_separate_ones_exactly(tiny_checkpoint):
    """One GEMM over the stacked q/k/v (gate/up) rows gives bit for bit what separate GEMMs give in
    float32 on CPU (each output is the same dot product), so merging changes no logit."""
    import torch.nn.functional as F

    model, config = load_model(tiny_checkpoint, attn_backend="torch")
    stored = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))

    class Separate(torch.nn.Module):                 # the unmerged layer: one F.linear per HF tensor
        def __init__(self, names):
            super().__init__()
            self.parts = [(stored[n + ".weight"], stored.get(n + ".bias")) for n in names]

        def forward(self, x):
            return torch.cat([F.linear(x, w, b) for w, b in self.parts], dim=-1)

    ids = list(range(3, 40))
    merged = PagedRunner(model, config, num_blocks=8).step([(0, ids)], num_prefills=1)
    x = torch.randn(len(ids), config.hidden_size)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = Separate([p + f"self_attn.{n}_proj" for n in "qkv"])
        gate_up = Separate([p + "mlp.gate_proj", p + "mlp.up_proj"])
        assert torch.equal(layer.self_attn.qkv_proj(x), qkv(x))
        assert torch.equal(layer.mlp.gate_up_proj(x), gate_up(x))
        layer.self_attn.qkv_proj, layer.mlp.gate_up_proj = qkv, gate_up
    separate = PagedRunner(model, config, num_blocks=8).step([(0, ids)], num_prefills=1)
    assert torch.equal(merged, separate)


def test_sharded_checkpoint_equals_single_file(tiny_checkpoint, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    a, config = load_model(path)
    b, _ = load_model(tiny_checkpoint)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
    shards = [dict(load_model(path, tp_rank=r, tp_size=2)[0].named_parameters()) for r in (0, 1)]
    whole = [dict(load_model(tiny_checkpoint, tp_rank=r, tp_size=2)[0].named_parameters()) for r in (0, 1)]
    assert all(torch.equal(s[n], w[n]) for s, w in zip(shards, whole) for n in s)
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
