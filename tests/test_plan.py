"""`randkv plan` against what is actually allocated on 8 simulated CPU devices: every array's
per-device bytes exactly, and the compiled, partitioned decode program's temporaries."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from randkv_jax import policies, sharding
from randkv_jax.cli import main
from randkv_jax.decode import DecodeSpec, decode_chunk, empty_state
from randkv_jax.models.config import ModelConfig, RopeConfig
from randkv_jax.models.model import init_params
from randkv_jax.plan import parse_bytes, plan
from randkv_jax.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")


def config(kv_heads=4, heads=8):
    return ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=32, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4),
        max_position_embeddings=8192, tie_word_embeddings=False, qk_norm=True,
    )


CASES = [
    ("data=1", "random", 4),
    ("data=2,model=4", "snapkv", 4),
    ("data=4,model=2", "h2o", 4),
    ("model=8", "random", 8),
    ("model=8", "full", 4),  # 4 KV heads on 8: attention and the buffer replicated
]


@pytest.mark.parametrize("mesh_text,policy_name,kv_heads", CASES)
def test_plan_matches_allocated_bytes_and_compiled_temporaries(mesh_text, policy_name, kv_heads):
    cfg = config(kv_heads, 2 * kv_heads)
    mesh = sharding.parse_mesh(mesh_text)
    policy = policies.get(policy_name) if policy_name == "full" else policies.get(policy_name, budget=128, window=32)
    p = plan(cfg, batch=8, prompt=100, generate=1000, policy=policy, mesh=dict(mesh.shape), dtype="float32")
    spec = DecodeSpec(cfg, jnp.float32, policy, SamplingParams(0.6, 0.95, 0), 64, "cpu", mesh)
    state = empty_state(spec, 8, p.capacity)
    state = jax.device_put(state, sharding.state_shardings(state, cfg, mesh))
    params = sharding.shard_params(init_params(cfg, jax.random.key(0)), cfg, mesh)
    device = mesh.devices.flat[0]

    def held(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)

    buffer = (state.buffer.keys, state.buffer.values, state.buffer.positions)
    assert p.params == held(params)
    assert p.kv_buffer == held(buffer)
    assert p.loop_state == held(state) - held(buffer)
    model = mesh.shape["model"]
    assert p.kv_split == (model if kv_heads % model == 0 else 1)
    compiled = decode_chunk.lower(params, state, jnp.int32(1), spec=spec).compile().memory_analysis()
    # the program's arguments: the parameters, the state but `emitted` (never read), max_steps (int32)
    assert compiled.argument_size_in_bytes == p.params + p.kv_buffer + p.loop_state - held(state.emitted) + 4
    assert abs(p.decode_temp - compiled.temp_size_in_bytes) <= 0.1 * compiled.temp_size_in_bytes


def test_full_cache_figure_and_the_budget_bound():
    cfg = config()
    random = plan(cfg, batch=8, prompt=100, generate=4000, policy=policies.RandomAttention(budget=256), dtype="float32")
    full = plan(cfg, batch=8, prompt=100, generate=4000, policy=policies.FullAttention(), dtype="float32")
    assert full.kv_buffer == random.full_cache_kv == full.full_cache_kv
    # T + interval slots, rounded up to blocks of 128, against prompt + generation
    assert random.capacity == 384 and full.capacity == 4224
    assert random.kv_buffer * 4224 == full.kv_buffer * 384


def test_cli_plan_and_refusal(capsys):
    argv = ["plan", "--model", "CFG", "--batch", "16", "--prompt", "512", "--generate", "8192", "--budget", "1024",
            "--mesh", "data=2,model=4", "--dtype", "bfloat16"]
    cfg_path = _write_config(config())
    argv[2] = cfg_path
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == {"data": 2, "model": 4} and out["fits"] is None
    assert out["total"] == out["params"] + out["kv_buffer"] + out["loop_state"] + out["activations"]
    assert main([*argv, "--device-memory", "8MiB"]) == 2
    captured = capsys.readouterr()
    assert "does NOT fit in 0.008 GiB" in captured.out
    assert "more than the 0.01 GiB given" in captured.err
    assert main([*argv, "--mesh", "data=3"]) == 2
    assert "batch=16 must be a multiple of the data axis (3)" in capsys.readouterr().err


def _write_config(cfg) -> str:
    import tempfile

    raw = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 8192, "tie_word_embeddings": False}
    path = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    path.write(json.dumps(raw))
    path.close()
    return path.name


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141 * 10**9 and parse_bytes("16e9") == 16e9
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
