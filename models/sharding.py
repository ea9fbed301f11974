"""The sharding rules: logical axis names per array dimension, mapped onto a device mesh.

One table (`RULES`) maps logical axes to mesh axes: requests (`batch`) over `data` (data
parallelism), attention heads, KV heads, the MLP hidden dimension and the vocabulary over `model`
(tensor parallelism). Each parameter leaf names its logical axes in `PARAM_AXES`; the decode
loop's state names its own in `randkv_jax.sharding`, through the same rules.

Uneven splits: a dimension that its mesh axis does not divide is replicated. Heads and KV heads
move together (query head h reads KV head h // g on the same device), so when the model axis does
not divide the KV-head count (Phi-4-reasoning's 10 KV heads on 4 or 8 devices), attention and
the KV buffer are replicated over `model` while the MLP and vocabulary stay split: correct, but
the buffer then costs its full size on every device (`randkv plan` says so). Pick a model axis
that divides the KV heads (Phi-4: 2, 5 or 10) to split the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from randkv_jax.models.config import ModelConfig
from randkv_jax.models.model import abstract_params

PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("embed", "embedding"): ("vocab", "embed"),
    ("layers", "attn_norm", "scale"): ("layers", "embed"),
    ("layers", "mlp_norm", "scale"): ("layers", "embed"),
    ("layers", "attn", "q_proj"): ("layers", "embed", "heads", "head_dim"),
    ("layers", "attn", "k_proj"): ("layers", "embed", "kv_heads", "head_dim"),
    ("layers", "attn", "v_proj"): ("layers", "embed", "kv_heads", "head_dim"),
    ("layers", "attn", "o_proj"): ("layers", "heads", "head_dim", "embed"),
    ("layers", "attn", "q_norm"): ("layers", "head_dim"),
    ("layers", "attn", "k_norm"): ("layers", "head_dim"),
    ("layers", "mlp", "gate_proj"): ("layers", "embed", "mlp"),
    ("layers", "mlp", "up_proj"): ("layers", "embed", "mlp"),
    ("layers", "mlp", "down_proj"): ("layers", "mlp", "embed"),
    ("final_norm", "scale"): ("embed",),
    ("lm_head",): ("embed", "vocab"),
}

RULES: dict[str, str | None] = {
    "batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model",
}
"""Logical axis -> mesh axis (None or absent: replicated). `embed`, `head_dim`, `layers` and
`slots` are never split."""


def rules_for(config: ModelConfig, mesh: Mesh, rules: dict[str, str | None] = RULES) -> dict[str, str | None]:
    """`rules` for this model on this mesh: heads and KV heads replicated together when the mesh
    axis of either does not divide its count (see the module docstring)."""
    rules = dict(rules)
    for name, count in (("heads", config.num_heads), ("kv_heads", config.num_kv_heads)):
        axis = rules.get(name)
        if axis is not None and count % mesh.shape.get(axis, 1):
            rules["heads"] = rules["kv_heads"] = None
    return rules


def heads_split(config: ModelConfig, mesh: Mesh | None) -> int:
    """How many ways the KV heads (and the KV buffer) are split on `mesh` (1: replicated)."""
    if mesh is None:
        return 1
    axis = rules_for(config, mesh).get("kv_heads")
    return mesh.shape.get(axis, 1) if axis is not None else 1


def spec_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: dict[str, str | None]) -> PartitionSpec:
    """The PartitionSpec of an array with these logical `axes`; an axis whose mesh axis is absent
    or does not divide its size is replicated."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match an array of shape {tuple(shape)}")
    spec = []
    for name, size in zip(axes, shape):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis not in mesh.shape or size % mesh.shape[mesh_axis]:
            mesh_axis = None
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def param_shardings(config: ModelConfig, mesh: Mesh, rules: dict[str, str | None] = RULES) -> Any:
    """A tree of `NamedSharding`s matching the parameter tree of `config` on `mesh`."""
    rules = rules_for(config, mesh, rules)

    def sharding(path, leaf):
        axes = PARAM_AXES[tuple(k.key for k in path)]
        return NamedSharding(mesh, spec_for(axes, leaf.shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(sharding, abstract_params(config))
