"""Meshes and the decode loop's shardings: data parallel over requests, tensor parallel over heads.

    mesh = parse_mesh("data=2,model=4")               # a 2 x 4 `jax.sharding.Mesh`
    model = load_model(path, mesh=mesh)                # parameters split by `models.sharding.RULES`
    engine = Engine(model, policy=..., slots=8, mesh=mesh)

Every array of the loop state names its logical axes here (`FIELD_AXES`), mapped onto the mesh by
the one rule table `models.sharding.RULES`: rows over `data`, KV heads (and the query heads of the
observation ring) over `model`. XLA's SPMD partitioner splits the decoder step from those
shardings (parameter and state shardings pinned, so nothing else is chosen for it). An eviction
round runs under `jax.shard_map` (`per_shard`): each device scores, selects and compacts the
(row, KV head) entries it holds, with no communication at all. Per-head randomness and statistics
use the global head numbers the buffer carries (`KVBuffer.heads`), so the keep-sets are those of
one device. A policy whose scores mix heads (TOVA: one score per layer over all heads) is refused
when the heads are split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from randkv_jax.models.config import ModelConfig
from randkv_jax.models.sharding import heads_split, param_shardings, rules_for, spec_for

MESH_AXES = ("data", "model")

FIELD_AXES: dict[str, tuple[str | None, ...]] = {
    # KVBuffer
    "keys": ("layers", "batch", "kv_heads", "slots", "head_dim"),
    "values": ("layers", "batch", "kv_heads", "slots", "head_dim"),
    "positions": ("layers", "batch", "kv_heads", "slots"),
    "prompt_lens": ("batch",),
    "fill": ("batch",),
    "generated": ("batch",),
    "heads": ("kv_heads",),
    # Observations
    "queries": ("layers", "batch", "heads", None, "head_dim"),
    "attention_sum": ("layers", "batch", "kv_heads", "slots"),
    # LoopState
    "last": ("batch",),
    "active": ("batch",),
    "n_new": ("batch",),
    "max_new": ("batch",),
    "stop_ids": ("batch", None),
    "emitted": ("batch", None),
    "evictions": ("batch",),
    "peak_slots": ("batch",),
    "held_after_round": ("batch",),
    "row_seeds": ("batch",),
    "rounds_run": (),
    "forced": ("batch", None),
    "emitted_logprob": ("batch", None),
    "emitted_greedy": ("batch", None),
}
"""Logical axes of every loop-state array, by field name (the names are unique across
`KVBuffer`, `Observations` and `LoopState`)."""


def mesh_sizes(text: str, devices: int | None = None) -> dict[str, int]:
    """"data=D,model=M" (either may be left out: size 1) -> {"data": D, "model": M}; "auto" takes
    data = `devices`."""
    sizes = {"data": 1, "model": 1}
    if text.strip() == "auto":
        if devices is None:
            raise ValueError("mesh 'auto' needs the device count: give data=D,model=M")
        sizes["data"] = devices
        return sizes
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh {text!r}: expected 'data=D,model=M' (positive sizes) or 'auto', "
                             f"got part {part!r}")
        sizes[name] = int(value)
    return sizes


def parse_mesh(text: str | None, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """A `Mesh` from "data=D,model=M" or "auto" (`mesh_sizes`), or None for None.

    The mesh takes the first D * M of `devices` (default: this process's local devices) and is
    refused with the counts when there are fewer."""
    if text is None:
        return None
    devices = list(jax.local_devices() if devices is None else devices)
    sizes = mesh_sizes(text, len(devices))
    need = sizes["data"] * sizes["model"]
    if need > len(devices):
        raise ValueError(f"mesh {text!r} needs {need} devices, this process has {len(devices)}")
    return jax.make_mesh((sizes["data"], sizes["model"]), MESH_AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=devices[:need])


def check_mesh(mesh: Mesh) -> None:
    """Refuse a mesh without exactly the axes `data` and `model`, both `AxisType.Auto` (the loop's
    shardings are constraints for XLA's partitioner, not explicit sharding types)."""
    hint = "build one with randkv_jax.sharding.parse_mesh('data=D,model=M')"
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"a mesh must have the axes {MESH_AXES} (in that order), got {tuple(mesh.axis_names)}; {hint}")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        raise ValueError(f"the mesh's axes must be AxisType.Auto, got {mesh.axis_types}; {hint}")


def _leaf_name(path) -> str:
    key = path[-1]
    name = getattr(key, "name", None)
    if name not in FIELD_AXES:
        raise ValueError(f"no sharding rule for loop-state field {jax.tree_util.keystr(path)!r}")
    return name


def state_specs(tree: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """PartitionSpecs for a loop-state pytree (a `LoopState`, `KVBuffer`, `Observations`, ...)."""
    rules = rules_for(config, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec_for(FIELD_AXES[_leaf_name(path)], leaf.shape, mesh, rules), tree)


def state_shardings(tree: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """`state_specs` as `NamedSharding`s on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(tree, config, mesh),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def constrain(tree: Any, config: ModelConfig, mesh: Mesh | None) -> Any:
    """`tree` pinned to its loop-state shardings inside a jitted function (unchanged without a mesh)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, state_shardings(tree, config, mesh))


def per_shard(fn: Callable, config: ModelConfig, mesh: Mesh | None, args: tuple, rows: tuple = ()) -> Any:
    """`fn(*args)` run on each device over the rows and KV heads it holds (`jax.shard_map`).

    `args` are loop-state pytrees (their specs from `FIELD_AXES`) and the arrays of `rows`
    (positions in `args`) per-row vectors; `fn` must return loop-state pytrees shaped like its
    inputs' shards. Without a mesh, `fn(*args)`."""
    if mesh is None:
        return fn(*args)
    rules = rules_for(config, mesh)
    row_spec = PartitionSpec(rules.get("batch") if rules.get("batch") in mesh.shape else None)
    in_specs = tuple(
        jax.tree.map(lambda leaf: row_spec, arg) if i in rows else state_specs(arg, config, mesh)
        for i, arg in enumerate(args)
    )
    out_abstract = jax.eval_shape(fn, *args)  # local shapes equal global ones up to the split axes
    out_specs = state_specs(out_abstract, config, mesh)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def check_policy(policy: Any, config: ModelConfig, mesh: Mesh | None) -> None:
    """Refuse a policy that cannot run with the KV heads split over `mesh`."""
    if heads_split(config, mesh) > 1 and getattr(policy, "scores_across_heads", False):
        raise ValueError(
            f"{type(policy).__name__} scores each slot over all heads of a layer, which a mesh splitting the "
            f"{config.num_kv_heads} KV heads {heads_split(config, mesh)} ways does not hold on one device: "
            "use model=1 (data parallel only)"
        )


def check_rows(rows: int, mesh: Mesh | None) -> None:
    """Refuse a slot count the data axis does not divide."""
    if mesh is not None and rows % mesh.shape["data"]:
        raise ValueError(f"slots={rows} must be a multiple of the mesh's data axis ({mesh.shape['data']})")


def shard_params(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
    """Parameters placed by `models.sharding.RULES` on `mesh` (a no-op when they already are)."""
    return jax.device_put(params, param_shardings(config, mesh))
