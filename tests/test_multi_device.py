"""Data- and tensor-parallel generation on 8 simulated CPU devices against one device.

Float32, the same seeds. Data parallel splits the rows, tensor parallel the KV heads (and the
parameters' heads, MLP and vocabulary); a model with 5 KV heads on an 8-way model axis runs with
attention replicated. Random Attention's keep-sets must be one device's exactly (the buffer's
positions after the run), every policy's tokens must be one device's, and teacher-forced logits
within 1e-5 (the partitioned reductions may sum in another order).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from randkv_jax import policies, sharding
from randkv_jax.decode import DecodeSpec, decode_chunk, empty_state
from randkv_jax.generate import generate
from randkv_jax.models import forward
from randkv_jax.models.config import ModelConfig, RopeConfig
from randkv_jax.models.model import Model, init_params
from randkv_jax.sampling import SamplingParams
from randkv_jax.sharding import parse_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices: "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py sets it)")

MESHES = ("data=8", "model=8", "data=2,model=4")
RULE = dict(budget=48, window=8, interval=8)
POLICIES = {
    "full": policies.FullAttention(),
    "random": policies.RandomAttention(**RULE),
    "snapkv": policies.SnapKV(**RULE),
}


def random_model(kv_heads: int, heads: int) -> Model:
    """A 2-layer Qwen3-shaped model with random float32 weights (doubled, so logits are not flat)."""
    config = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=16, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4),
        max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True,
    )
    params = jax.tree.map(lambda x: 2 * x if x.ndim > 1 else x, init_params(config, jax.random.key(1)))
    return Model(config, params, None, jnp.float32)


MODELS = {"kv8": (8, 16), "kv5": (5, 10)}  # 5 KV heads do not divide the 8-way model axis


@pytest.fixture(scope="module")
def models():
    return {name: random_model(*shape) for name, shape in MODELS.items()}


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 19, 40, 7, 12, 33, 21, 9)]


def run(model, policy, mesh=None):
    return generate(model, prompts(), policy=policy, max_new_tokens=64, chat=False, ignore_eos=True,
                    temperature=0.7, seed=11, mesh=mesh, return_state=True)


@pytest.fixture(scope="module")
def one_device(models):
    return {(m, p): run(models[m], POLICIES[p]) for m in MODELS for p in POLICIES}


@pytest.mark.parametrize("mesh_text", MESHES)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_generation_matches_one_device(models, one_device, model_name, policy, mesh_text):
    mesh = parse_mesh(mesh_text)
    out, ref = run(models[model_name], POLICIES[policy], mesh), one_device[(model_name, policy)]
    assert out.tokens == ref.tokens
    if policy != "full":
        assert all(s.evictions > 1 for s in out.stats)
    keys = out.state.buffer.keys
    split = sharding.heads_split(models[model_name].config, mesh)
    assert split == (1 if model_name == "kv5" else mesh.shape["model"])
    assert keys.addressable_shards[0].data.shape[2] == keys.shape[2] // split
    if policy == "random":  # the keep-sets of every (layer, row, head), exactly
        np.testing.assert_array_equal(np.asarray(out.state.buffer.positions), np.asarray(ref.state.buffer.positions))


@pytest.mark.parametrize("mesh_text", ("model=8", "data=2,model=4"))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_teacher_forced_logits_match_one_device(models, model_name, mesh_text):
    model = models[model_name]
    sharded = Model(model.config, sharding.shard_params(model.params, model.config, parse_mesh(mesh_text)),
                    None, jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 256, size=(4, 40)), jnp.int32)
    np.testing.assert_allclose(np.asarray(forward(sharded, tokens)), np.asarray(forward(model, tokens)),
                               atol=1e-5, rtol=0)


COLLECTIVE = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\][^ ]* (all-gather|all-to-all|collective-permute)(?:-start)?\(")


def buffer_sized_collectives(model, policy, mesh) -> list[str]:
    """Collectives in the compiled, partitioned decode loop that move at least one layer's
    per-device share of the keys (rows and KV heads held by one device, all slots)."""
    spec = DecodeSpec(model.config, jnp.float32, policy, SamplingParams(0.7, 1.0, 0), 8, "cpu", mesh)
    state = empty_state(spec, 8, 256)
    state = jax.device_put(state, sharding.state_shardings(state, model.config, mesh))
    params = sharding.shard_params(model.params, model.config, mesh)
    text = decode_chunk.lower(params, state, jnp.int32(8), spec=spec).compile().as_text()
    _, b, k, s, d = state.buffer.keys.shape
    one_layer = (b // mesh.shape["data"]) * (k // sharding.heads_split(model.config, mesh)) * s * d
    found = []
    for dtype, dims, op in COLLECTIVE.findall(text):
        size = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
        if size >= one_layer:
            found.append(f"{op} {dtype}[{dims}]")
    return found


@pytest.mark.parametrize("mesh_text", ("model=8", "data=2,model=4"))
@pytest.mark.parametrize("policy", ["random", "snapkv"])
def test_tensor_parallel_loop_moves_no_buffer_between_devices(models, monkeypatch, policy, mesh_text):
    model, mesh = models["kv8"], parse_mesh(mesh_text)
    assert buffer_sized_collectives(model, POLICIES[policy], mesh) == []
    # control: a buffer deliberately replicated over the model axis between steps (rounds still
    # run per head shard) must be gathered after each round: the check has to see it. Shardings
    # are read when the loop is traced, so jax's trace caches are cleared around the change.
    per_field = sharding.state_shardings

    def buffer_replicated(tree, config, mesh):
        return jax.tree_util.tree_map_with_path(
            lambda path, s: NamedSharding(mesh, PartitionSpec()) if path[-1].name in ("keys", "values", "positions")
            else s, per_field(tree, config, mesh))

    monkeypatch.setattr(sharding, "state_shardings", buffer_replicated)
    jax.clear_caches()
    try:
        assert any(c.startswith("all-gather") for c in buffer_sized_collectives(model, POLICIES[policy], mesh))
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_policy_mixing_heads_is_refused_when_heads_are_split(models):
    tova = policies.TOVA(**RULE)
    with pytest.raises(ValueError, match="all heads of a layer.*model=1"):
        run(models["kv8"], tova, parse_mesh("model=8"))
    ref = run(models["kv8"], tova)
    assert run(models["kv8"], tova, parse_mesh("data=8")).tokens == ref.tokens


def test_parse_mesh():
    assert parse_mesh(None) is None
    assert dict(parse_mesh("auto").shape) == {"data": jax.local_device_count(), "model": 1}
    assert dict(parse_mesh("model=4").shape) == {"data": 1, "model": 4}
    for bad, match in (("data=0", "positive"), ("pipe=2", "expected"), ("data=2,model", "expected"),
                       ("data=4,model=4", "needs 16 devices")):
        with pytest.raises(ValueError, match=match):
            parse_mesh(bad)


def test_slots_must_divide_over_the_data_axis(models):
    from randkv_jax.engine import Engine

    with pytest.raises(ValueError, match="multiple of the mesh's data axis"):
        Engine(models["kv8"], policy=POLICIES["random"], slots=6, mesh=parse_mesh("data=4"), max_prompt_tokens=64,
               max_new_tokens=64)


def test_example_script_runs_the_loop_under_pmap_and_shard_map():
    """examples/shard_decode.py: `decode_chunk` mapped over 8 devices by jax.pmap and jax.shard_map,
    two rows per device, each row's tokens equal to one device's (`--check` exits 1 otherwise)."""
    script = Path(__file__).parents[1] / "examples" / "shard_decode.py"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, str(script), "--devices", "8", "--rows-per-device", "2",
                           "--max-new-tokens", "64", "--check"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("pmap", "shard_map"):
        assert f"{name}: 8 devices x 2 rows, 64 tokens each; 16/16 rows equal to one device" in done.stdout
