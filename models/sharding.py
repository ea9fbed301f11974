"""Parameter shardings: logical axis names per parameter leaf, mapped onto a device mesh.

Each leaf of the parameter tree gets logical axes (`PARAM_AXES`); `RULES` map logical axes to
mesh axes (tensor parallelism over `model`: heads, KV heads, MLP hidden and vocabulary). A
dimension that the mesh axis does not divide (Phi-4's 10 KV heads on 4 devices) is replicated
rather than refused.
"""

from __future__ import annotations

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

RULES: dict[str, str | None] = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}


def param_shardings(config: ModelConfig, mesh: Mesh, rules: dict[str, str | None] = RULES) -> Any:
    """A tree of `NamedSharding`s matching the parameter tree of `config` on `mesh`."""

    def sharding(path, leaf):
        axes = PARAM_AXES[tuple(k.key for k in path)]
        spec = []
        for name, size in zip(axes, leaf.shape):
            mesh_axis = rules.get(name)
            if mesh_axis not in mesh.shape or size % mesh.shape[mesh_axis]:
                mesh_axis = None
            spec.append(mesh_axis)
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(sharding, abstract_params(config))
