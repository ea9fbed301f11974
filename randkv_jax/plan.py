"""`randkv plan`: the bytes a generation run needs per device, before anything is allocated.

    p = plan(config, batch=128, prompt=1024, generate=32768, policy=RandomAttention(budget=2048),
             mesh={"data": 8, "model": 8}, dtype="bfloat16")
    print(p.table())

Parameters, the KV buffer and the rest of the loop state are counted exactly from their abstract
shapes (`jax.eval_shape`) and their shardings (`models.sharding.RULES`, `sharding.FIELD_AXES`):
the bytes of one device's shard of every array. Activations are the XLA temporaries of the decode
program and of one prompt's prefill, from compiling them (never running them) for one device at
the per-device shapes (rows / data, heads, KV heads, MLP and vocabulary / model): compilation
allocates nothing on the device. On a mesh that estimate leaves out the partitioner's
communication buffers. Programs compile for this process's default backend; XLA:CPU upcasts
bfloat16 weights to float32 in temporaries (a CPU artefact), so a bfloat16 plan made on a CPU
compiles its activations in float32 instead: an upper bound of an accelerator's bfloat16
temporaries (`MemoryPlan.note` says so). The peak adds the larger of the two programs' temporaries, plus one
prefilled prompt waiting for its slot, to what stays resident (parameters and loop state).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from randkv_jax import sharding
from randkv_jax.decode import DecodeSpec, decode_chunk, empty_state, padded_capacity, prefill
from randkv_jax.engine import DEFAULT_CHUNK, bucket
from randkv_jax.models.config import ModelConfig
from randkv_jax.models.model import abstract_params, resolve_dtype
from randkv_jax.models.sharding import PARAM_AXES, heads_split, rules_for, spec_for
from randkv_jax.sampling import SamplingParams

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (the busiest device: shards are equal or replicated)."""

    devices: dict[str, int]  # mesh axis sizes
    capacity: int  # KV slots per row
    params: int
    kv_buffer: int  # keys, values and positions
    loop_state: int  # observations and the per-row vectors
    decode_temp: int  # XLA temporaries of a decode chunk
    prefill_temp: int  # of one prompt's prefill
    prefilled: int  # one prefilled prompt (its KV entries) waiting for a slot
    full_cache_kv: int  # the KV buffer a full cache would need for the same run
    kv_split: int  # ways the KV heads are split (1: replicated over `model`)
    device_memory: int | None = None
    note: str = ""  # how the activations were estimated

    @property
    def activations(self) -> int:
        return max(self.decode_temp, self.prefill_temp) + self.prefilled

    @property
    def total(self) -> int:
        return self.params + self.kv_buffer + self.loop_state + self.activations

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory

    def table(self) -> str:
        rows = [("parameters", self.params), ("KV buffer", self.kv_buffer), ("loop state", self.loop_state),
                ("activations", self.activations), ("total", self.total)]
        mesh = " x ".join(f"{k}={v}" for k, v in self.devices.items())
        lines = [f"per device ({mesh}; {self.capacity} KV slots per row; KV heads split {self.kv_split} ways):"]
        lines += [f"  {name:12s} {_gib(value):>10s}" for name, value in rows]
        lines.append(f"  (a full cache: KV buffer {_gib(self.full_cache_kv)}; with the parameters and loop state "
                     f"{_gib(self.params + self.loop_state + self.full_cache_kv)})")
        if self.note:
            lines.append(f"  ({self.note})")
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {_gib(self.device_memory)} of device memory")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB"


def _abstract_mesh(devices: dict[str, int]) -> AbstractMesh:
    sizes = tuple(devices.get(a, 1) for a in sharding.MESH_AXES)
    return AbstractMesh(sizes, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 2)


def _local_bytes(tree: Any, specs: Any, mesh: AbstractMesh) -> int:
    """Bytes of one device's shard of every array of `tree` under `specs`."""
    total = 0
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        split = math.prod(mesh.shape[a] for a in spec if a is not None)
        total += leaf.size * jnp.dtype(leaf.dtype).itemsize // split
    return total


def _param_specs(config: ModelConfig, mesh: AbstractMesh, params: Any) -> Any:
    rules = rules_for(config, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(PARAM_AXES[tuple(k.key for k in path)], leaf.shape, mesh, rules), params)


def local_config(config: ModelConfig, devices: dict[str, int]) -> ModelConfig:
    """The model one device computes on a mesh: heads, KV heads, MLP and vocabulary divided by the
    model axis where the rules split them."""
    mesh = _abstract_mesh(devices)
    rules, m = rules_for(config, mesh), mesh.shape["model"]
    div = lambda name, n: n // m if rules.get(name) == "model" and n % m == 0 else n  # noqa: E731
    return dataclasses.replace(
        config, num_heads=div("heads", config.num_heads), num_kv_heads=div("kv_heads", config.num_kv_heads),
        intermediate_size=div("mlp", config.intermediate_size), vocab_size=div("vocab", config.vocab_size),
    )


def _temp_bytes(compiled) -> int:
    analysis = compiled.memory_analysis()
    return 0 if analysis is None else int(analysis.temp_size_in_bytes)


def plan(
    config: ModelConfig,
    *,
    batch: int,
    prompt: int,
    generate: int,
    policy: Any,
    mesh: dict[str, int] | None = None,
    dtype: str | Any = "bfloat16",
    chunk: int = DEFAULT_CHUNK,
    device_memory: int | None = None,
) -> MemoryPlan:
    """The per-device bytes of `batch` rows with `prompt`-token prompts generating `generate`
    tokens under `policy` on a mesh of `mesh` axis sizes ({"data": D, "model": M}; default one device)."""
    for name, value in (("batch", batch), ("prompt", prompt), ("generate", generate)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    devices = {"data": 1, "model": 1, **(mesh or {})}
    if set(devices) != set(sharding.MESH_AXES):
        raise ValueError(f"mesh axes must be {sharding.MESH_AXES}, got {tuple(devices)}")
    if batch % devices["data"]:
        raise ValueError(f"batch={batch} must be a multiple of the data axis ({devices['data']})")
    dtype = resolve_dtype(dtype)
    abstract_mesh = _abstract_mesh(devices)
    sampling = SamplingParams(0.6, 0.95, 0)
    interval = policy.interval
    spec = DecodeSpec(config, dtype, policy, sampling, -(-chunk // interval) * interval, "cpu")
    capacity = padded_capacity(policy, bucket(prompt), generate)
    state = jax.eval_shape(functools.partial(empty_state, spec, batch, capacity))
    state_specs = sharding.state_specs(state, config, abstract_mesh)
    params = abstract_params(config, dtype)
    kv_buffer = _local_bytes((state.buffer.keys, state.buffer.values, state.buffer.positions),
                             (state_specs.buffer.keys, state_specs.buffer.values, state_specs.buffer.positions),
                             abstract_mesh)
    from randkv_jax.policies import FullAttention

    full_capacity = padded_capacity(FullAttention(), bucket(prompt), generate)
    full_kv = kv_buffer * full_capacity // capacity

    # activations: compile (never run) the per-device programs of one device
    backend = jax.default_backend()
    compile_dtype = jnp.float32 if backend == "cpu" and dtype == jnp.bfloat16 else dtype
    note = f"activations compiled for {backend} in {jnp.dtype(compile_dtype).name}"
    if compile_dtype != dtype:
        note += " (XLA:CPU upcasts bfloat16 weights: an upper bound of an accelerator's bfloat16 temporaries)"
    local = local_config(config, devices)
    local_spec = dataclasses.replace(spec, config=local, dtype=compile_dtype)
    local_params = abstract_params(local, compile_dtype)
    local_state = jax.eval_shape(functools.partial(empty_state, local_spec, batch // devices["data"], capacity))
    decode_temp = _temp_bytes(decode_chunk.lower(local_params, local_state, jnp.int32(1), spec=local_spec).compile())
    t = bucket(prompt)
    tokens, lens = jax.ShapeDtypeStruct((1, t), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    lowered = prefill.lower(local_params, tokens, lens, spec=local_spec)
    prefill_temp = _temp_bytes(lowered.compile())
    waiting = jax.eval_shape(functools.partial(prefill, spec=dataclasses.replace(local_spec, dtype=dtype)),
                             abstract_params(local, dtype), tokens, lens)
    prefilled = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(waiting))
    return MemoryPlan(
        devices=devices, capacity=capacity,
        params=_local_bytes(params, _param_specs(config, abstract_mesh, params), abstract_mesh),
        kv_buffer=kv_buffer, loop_state=_local_bytes(state, state_specs, abstract_mesh) - kv_buffer,
        decode_temp=decode_temp, prefill_temp=prefill_temp, prefilled=prefilled, full_cache_kv=full_kv,
        kv_split=heads_split(config, abstract_mesh), device_memory=device_memory, note=note,
    )


def parse_bytes(text: str) -> int:
    """"80GiB", "141GB", "16e9" -> bytes."""
    units = {"gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "b": 1}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            number = lowered[: -len(unit)]
            break
    else:
        number, scale = lowered, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"cannot read a byte count from {text!r} (e.g. 80GiB, 141GB)") from None
    if value <= 0:
        raise ValueError(f"device memory must be positive, got {text!r}")
    return int(value)
