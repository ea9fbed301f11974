"""Hugging Face safetensors checkpoints -> the decoder's parameter tree.

The conversion is a table (`key_table`): each entry names a Hugging Face tensor (a pattern with
`{i}` for the layer), the shape it must have, and the parameter leaf (or leaves: Phi-3's fused
`qkv_proj` and `gate_up_proj` are split by rows) it fills. Torch `Linear` weights are
`[out, in]`; ours are `[in, ...out]`, so they are transposed and reshaped to the leaf's shape.

Loading streams one parameter leaf at a time: a host buffer for that leaf is filled tensor by
tensor (read with the `safetensors` library, `safetensors_file`; only the needed rows), moved to
the device (with its sharding when one is given), and released, so host memory peaks at one leaf
beyond the parameters themselves. Every problem is an error naming the tensor (missing,
unexpected, duplicate, wrong shape, an `lm_head` that differs from tied embeddings) or the file
(truncated or corrupted). Pickle checkpoints (`.bin`, `.pt`) are refused: unpickling can run
arbitrary code.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from randkv_jax.models.config import ModelConfig
from randkv_jax.models.model import abstract_params
from randkv_jax.models.safetensors_file import TensorInfo, read_header, read_tensor

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Tensors some checkpoints carry that are recomputed, not loaded.
IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model its config.json describes."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One parameter leaf filled from (some rows of) an HF tensor."""

    path: tuple[str, ...]  # path in the parameter tree
    rows: tuple[int, int] | None = None  # rows [start, stop) of the HF tensor
    transpose: bool = True  # torch Linear [out, in] -> [in, out], then reshape to the leaf


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_key: str  # e.g. "model.layers.{i}.self_attn.q_proj.weight"
    hf_shape: tuple[int, ...]
    targets: tuple[Target, ...]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_key

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.hf_key).replace(r"\{i\}", r"(\d+)"))


def key_table(c: ModelConfig) -> list[Rule]:
    """The conversion table for `c`'s architecture."""
    e, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = "model.layers.{i}."

    def norm(key, *path):
        return Rule(key, (e,), (Target(path, transpose=False),))

    def linear(key, shape, *path):
        return Rule(key, shape, (Target(path),))

    rules = [
        Rule("model.embed_tokens.weight", (v, e), (Target(("embed", "embedding"), transpose=False),)),
        norm("model.norm.weight", "final_norm", "scale"),
        norm(layer + "input_layernorm.weight", "layers", "attn_norm", "scale"),
        norm(layer + "post_attention_layernorm.weight", "layers", "mlp_norm", "scale"),
        linear(layer + "self_attn.o_proj.weight", (e, q), "layers", "attn", "o_proj"),
        linear(layer + "mlp.down_proj.weight", (e, f), "layers", "mlp", "down_proj"),
    ]
    if c.fused_projections:
        attn = ("layers", "attn")
        rules.append(Rule(layer + "self_attn.qkv_proj.weight", (q + 2 * kv, e), (
            Target((*attn, "q_proj"), rows=(0, q)),
            Target((*attn, "k_proj"), rows=(q, q + kv)),
            Target((*attn, "v_proj"), rows=(q + kv, q + 2 * kv)),
        )))
        rules.append(Rule(layer + "mlp.gate_up_proj.weight", (2 * f, e), (
            Target(("layers", "mlp", "gate_proj"), rows=(0, f)),
            Target(("layers", "mlp", "up_proj"), rows=(f, 2 * f)),
        )))
    else:
        rules += [
            linear(layer + "self_attn.q_proj.weight", (q, e), "layers", "attn", "q_proj"),
            linear(layer + "self_attn.k_proj.weight", (kv, e), "layers", "attn", "k_proj"),
            linear(layer + "self_attn.v_proj.weight", (kv, e), "layers", "attn", "v_proj"),
            linear(layer + "mlp.gate_proj.weight", (f, e), "layers", "mlp", "gate_proj"),
            linear(layer + "mlp.up_proj.weight", (f, e), "layers", "mlp", "up_proj"),
        ]
    if c.qk_norm:
        d = (c.head_dim,)
        rules.append(Rule(layer + "self_attn.q_norm.weight", d, (Target(("layers", "attn", "q_norm"), transpose=False),)))
        rules.append(Rule(layer + "self_attn.k_norm.weight", d, (Target(("layers", "attn", "k_norm"), transpose=False),)))
    if not c.tie_word_embeddings:
        rules.append(linear("lm_head.weight", (v, e), "lm_head"))
    return rules


def find_safetensors(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (single file or index + shards)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        files = sorted({directory / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} lists shard {file.name}, which does not exist")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    refuse_pickle(directory)
    shards = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if shards:
        return shards
    raise CheckpointError(f"no safetensors weights in {directory} (model.safetensors or an index)")


def refuse_pickle(path: Path) -> None:
    """Raise if `path` is, or its directory holds, pickle weights (`.bin`, `.pt`, ...)."""
    for p in [path] if path.is_file() else sorted(path.iterdir()):
        if p.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(
                f"refusing pickle checkpoint {p.name}: loading it can run arbitrary code; "
                "convert it to safetensors first"
            )


def plan_tensors(config: ModelConfig, files: list[Path]) -> dict[tuple[str, ...], list]:
    """Match every stored tensor to the table: {leaf path: [(layer|None, TensorInfo, Target)]}.

    Raises on unexpected, duplicate, missing or wrongly shaped tensors, naming the tensor, and
    on an `lm_head` stored beside tied embeddings that is not equal to them.
    """
    stored: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in stored:
                raise CheckpointError(f"duplicate tensor {name} in {stored[name].file.name} and {file.name}")
            stored[name] = info
    rules = key_table(config)
    plan: dict[tuple[str, ...], list] = {}
    seen: set[str] = set()
    for name, info in stored.items():
        if any(p.fullmatch(name) for p in IGNORED):
            continue
        rule, layer = _match(rules, name, config.num_layers)
        if rule is None:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                _check_tied_head(stored)
                continue
            raise CheckpointError(f"unexpected tensor {name}: no parameter of {config.architecture} maps to it")
        if info.shape != rule.hf_shape:
            raise CheckpointError(f"tensor {name} has shape {info.shape}, expected {rule.hf_shape}")
        seen.add(name)
        for target in rule.targets:
            plan.setdefault(target.path, []).append((layer, info, target))
    for rule in rules:
        for i in range(config.num_layers) if rule.per_layer else [None]:
            key = rule.hf_key.format(i=i)
            if key not in seen:
                raise CheckpointError(f"missing tensor {key} ({config.architecture} needs it)")
    return plan


def _match(rules: list[Rule], name: str, num_layers: int) -> tuple[Rule | None, int | None]:
    for rule in rules:
        m = rule.pattern.fullmatch(name)
        if m:
            layer = int(m.group(1)) if rule.per_layer else None
            if layer is not None and layer >= num_layers:
                return None, None
            return rule, layer
    return None, None


def load_safetensors_params(
    config: ModelConfig,
    directory: str | Path,
    dtype: Any,
    shardings: Any = None,
    progress: Callable[[str], None] | None = None,
) -> Any:
    """Read a checkpoint directory into the parameter tree (leaves in `dtype`)."""
    directory = Path(directory)
    files = find_safetensors(directory)
    plan = plan_tensors(config, files)
    abstract = abstract_params(config, dtype)
    flat = {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    flat_shardings = (
        {tuple(k.key for k in p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
        if shardings is not None else {}
    )
    loaded = {}
    for path, leaf in flat.items():
        if progress:
            progress("/".join(path))
        host = np.empty(leaf.shape, leaf.dtype)
        for layer, info, target in plan[path]:
            part = read_tensor(info, target.rows)
            if target.transpose:
                part = part.T
            dest = host if layer is None else host[layer]
            dest[...] = part.reshape(dest.shape)  # casts on assignment: no extra copy
            del part
        loaded[path] = jax.device_put(host, flat_shardings.get(path))
        del host
    return _unflatten(loaded)


def _check_tied_head(stored: dict[str, TensorInfo]) -> None:
    """A stored lm_head beside tied embeddings must equal them (it is then dropped)."""
    head, embed = stored["lm_head.weight"], stored.get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape or not np.array_equal(read_tensor(head), read_tensor(embed)):
        raise CheckpointError(
            "lm_head.weight differs from model.embed_tokens.weight, "
            "but config.json says tie_word_embeddings=true"
        )


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
