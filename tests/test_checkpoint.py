"""`randkv convert` -> Orbax checkpoint -> `load_model`, plain and sharded over a mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import randkv_jax
from randkv_jax.sharding import parse_mesh
from randkv_jax.cli import main
from randkv_jax.models import forward
from tests.hf_tiny import save_tiny


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = tmp_path_factory.mktemp("hf")
    save_tiny("phi3_partial", src)
    out = tmp_path_factory.mktemp("converted") / "model"
    assert main(["convert", str(src), "--out", str(out), "--dtype", "float32"]) == 0
    return src, out


def _tokens():
    return np.random.default_rng(0).integers(3, 256, size=(2, 16)).astype(np.int32)


def test_converted_checkpoint_restores_the_same_model(converted):
    src, out = converted
    direct = randkv_jax.load_model(src, dtype="float32")
    restored = randkv_jax.load_model(out, dtype="float32")
    assert restored.config == direct.config
    for a, b in zip(jax.tree.leaves(direct.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(forward(direct, _tokens())), np.asarray(forward(restored, _tokens())))


def test_restore_casts_to_the_requested_dtype(converted):
    _, out = converted
    model = randkv_jax.load_model(out, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {np.dtype(jax.numpy.bfloat16)}


def test_sharded_restore_over_a_mesh(converted):
    src, out = converted
    if jax.device_count() < 4:
        pytest.skip("needs 4 (fake CPU) devices: XLA_FLAGS=--xla_force_host_platform_device_count=4")
    mesh = parse_mesh("data=2,model=2")
    for path in (out, src):  # converted (Orbax) and direct HF loading both honour the mesh
        model = randkv_jax.load_model(path, dtype="float32", mesh=mesh)
        q = model.params["layers"]["attn"]["q_proj"]
        assert q.sharding.spec == PartitionSpec(None, None, "model", None)
        assert len(q.addressable_shards) == 4 and q.addressable_shards[0].data.shape[2] == 2
        reference = randkv_jax.load_model(src, dtype="float32")
        np.testing.assert_allclose(
            np.asarray(forward(model, _tokens())), np.asarray(forward(reference, _tokens())), atol=1e-5
        )


def test_convert_refuses_a_non_empty_output(converted, capsys):
    src, out = converted
    assert main(["convert", str(src), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err


def test_default_dtype_follows_the_backend(converted):
    from randkv_jax.models.model import default_dtype

    assert (default_dtype("cpu"), default_dtype("gpu"), default_dtype("tpu")) == ("float32", "bfloat16", "bfloat16")
    _, out = converted
    model = randkv_jax.load_model(out)  # this suite runs on CPU
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {np.dtype(np.float32)}
