"""Config reading, parameter counts of the real models, and every refused input."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import randkv_jax
from randkv_jax.models import ConfigError, abstract_params, read_hf_config
from randkv_jax.models.hf import CheckpointError
from randkv_jax.models.safetensors_file import SafetensorsError
from tests.hf_tiny import save_tiny

SHARED = Path(__file__).resolve().parents[2] / "shared"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _real_configs() -> list[Path]:
    configs = sorted((SHARED / "configs").glob("*.config.json"))
    return configs + [FIXTURES / "phi-4-reasoning.config.json"]


def _count(tree) -> int:
    import jax

    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("path", _real_configs(), ids=lambda p: p.name.split(".config")[0])
def test_real_config_parameter_count_equals_transformers(path):
    if not path.exists():
        pytest.skip(f"{path} not found: ../shared is absent")
    config = read_hf_config(path)
    ours = _count(abstract_params(config))
    hf_config = transformers.AutoConfig.for_model(**{
        k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")
    })
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert ours == sum(p.numel() for p in hf_model.parameters())


def test_published_parameter_counts():
    """Two counts that are public knowledge, independent of transformers."""
    if not (SHARED / "configs").exists():
        pytest.skip("../shared/configs not found")
    assert _count(abstract_params(read_hf_config(SHARED / "configs/qwen3-0.6b.config.json"))) == 596_049_920
    assert _count(abstract_params(read_hf_config(FIXTURES / "phi-4-reasoning.config.json"))) == 14_659_507_200


def test_4x_and_5x_config_layouts_agree(tmp_path):
    save_tiny("phi3_longrope", tmp_path)
    v5 = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in v5
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(v5["rope_parameters"])
    v4["rope_theta"] = rope.pop("rope_theta")
    v4["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    v4["original_max_position_embeddings"] = rope.pop("original_max_position_embeddings")
    v4["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    v4["torch_dtype"] = v5.get("dtype", "float32")
    (tmp_path / "v4").mkdir()
    (tmp_path / "v4" / "config.json").write_text(json.dumps(v4))
    assert read_hf_config(tmp_path / "v4") == read_hf_config(tmp_path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    save_tiny("qwen3_untied", directory)
    return directory


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(checkpoint, out)
    return out


def _rewrite(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _one_line_error(exc_type, directory, *needles):
    with pytest.raises(exc_type) as info:
        randkv_jax.load_model(directory, dtype="float32")
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_missing_tensor(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    _one_line_error(CheckpointError, d, "missing tensor model.layers.1.self_attn.k_norm.weight")


def test_unexpected_tensor(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    _one_line_error(CheckpointError, d, "unexpected tensor model.layers.0.self_attn.q_proj.bias")


def test_tensor_of_a_layer_beyond_the_config(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}))
    _one_line_error(CheckpointError, d, "unexpected tensor model.layers.2.input_layernorm.weight")


def test_wrong_shape(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((95, 64), np.float32)}))
    _one_line_error(CheckpointError, d, "model.layers.0.mlp.up_proj.weight", "(95, 64)", "(96, 64)")


def test_duplicate_tensor_across_shards(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = dict(tensors), {names[0]: tensors[names[0]]}
    save_file(first, d / "model-00001-of-00002.safetensors")
    save_file(second, d / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _one_line_error(CheckpointError, d, f"duplicate tensor {names[0]}")


def test_truncated_safetensors(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    file = d / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    _one_line_error(SafetensorsError, d, str(file), "truncated safetensors file")


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _edit(header: dict, name: str, **fields) -> dict:
    return {**header, name: {**header[name], **fields}}


NORM = "model.norm.weight"  # float32, shape (64,)


# Each edit maps (file bytes, parsed header, data section) to the corrupted file's bytes.
@pytest.mark.parametrize("corrupt, needle", [
    (lambda raw, h, data: raw[:5], "header too small"),
    (lambda raw, h, data: raw[:len(raw) - len(data) - 10], "invalid header length"),
    (lambda raw, h, data: struct.pack("<Q", len(raw)) + raw[8:], "invalid header length"),
    (lambda raw, h, data: struct.pack("<Q", 10) + b"not json!!" + data, "invalid JSON in header"),
    (lambda raw, h, data: raw + bytes(8), "file not fully covered"),
    (lambda raw, h, data: _with_header(
        _edit(h, NORM, data_offsets=[o + 4 for o in h[NORM]["data_offsets"]]), data + bytes(4)),
     f"invalid offset for tensor `{NORM}`"),
    (lambda raw, h, data: _with_header(_edit(h, NORM, shape=[32]), data), f"for tensor {NORM}"),
    (lambda raw, h, data: _with_header(_edit(h, NORM, dtype="U32"), data), f"tensor {NORM} has unsupported dtype U32"),
], ids=["no header", "truncated header", "header longer than the file", "garbage header",
        "trailing bytes", "wrong data_offsets", "bytes do not match the shape", "unsupported dtype"])
def test_corrupted_safetensors(checkpoint, tmp_path, corrupt, needle):
    d = _copy(checkpoint, tmp_path)
    file = d / "model.safetensors"
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    file.write_bytes(corrupt(raw, json.loads(raw[8:8 + n]), raw[8 + n:]))
    _one_line_error(SafetensorsError, d, str(file), needle)


def test_tied_lm_head_must_equal_embeddings(tmp_path):
    save_tiny("qwen3_tied", tmp_path)
    embed = load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": embed.copy()}))
    randkv_jax.load_model(tmp_path, dtype="float32")  # an equal copy is accepted and dropped
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": embed + 1}))
    _one_line_error(CheckpointError, tmp_path, "lm_head.weight differs")


@pytest.mark.parametrize("edit, needle", [
    ({"architectures": ["MixtralForCausalLM"]}, "unsupported architecture 'MixtralForCausalLM'"),
    ({"num_experts": 8}, "mixture of experts"),
    ({"attention_bias": True}, "biases"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "unsupported RoPE type 'dynamic'"),
])
def test_unsupported_config(checkpoint, tmp_path, edit, needle):
    d = _copy(checkpoint, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config.update(edit)
    (d / "config.json").write_text(json.dumps(config))
    _one_line_error(ConfigError, d, needle)


def test_pickle_checkpoint_is_refused(checkpoint, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(checkpoint / "config.json", d)
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    _one_line_error(CheckpointError, d, "pytorch_model.bin", "arbitrary code")
    _one_line_error(CheckpointError, d / "pytorch_model.bin", "arbitrary code")


def test_missing_config(checkpoint, tmp_path):
    d = _copy(checkpoint, tmp_path)
    (d / "config.json").unlink()
    _one_line_error(ConfigError, d, "no config.json")


def test_missing_directory(tmp_path):
    _one_line_error(FileNotFoundError, tmp_path / "nope", "no checkpoint")
