"""ModelConfig: the decoder's hyper-parameters, read from a Hugging Face `config.json`.

One frozen, hashable dataclass describes Qwen3, Phi-3/Phi-4 and Llama checkpoints; the decoder
never looks at the architecture name, only at these fields. Both `config.json` layouts are read:

- transformers 4.x: top-level `rope_theta`, `rope_scaling`, `partial_rotary_factor`, `torch_dtype`;
- transformers 5.x: `rope_parameters` (which holds `rope_theta`, `rope_type`, ...) and `dtype`.

Anything the decoder does not implement (sliding-window layers, mixture of experts, biases,
other activations or RoPE types) is refused with a `ConfigError` that names it, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

ARCHITECTURES = ("Qwen3ForCausalLM", "Phi3ForCausalLM", "LlamaForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class ConfigError(ValueError):
    """A config.json that is missing, malformed, or describes a model this decoder cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings (shared by every layer).

    `inv_freq`/`attention_scaling` are derived from these in `randkv_jax.models.rope`.
    """

    theta: float
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope
    attention_factor: float | None = None  # longrope / yarn; None = the published default
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters. Hashable, so it can be a static argument of `jax.jit`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    checkpoint_dtype: str = "float32"  # dtype the checkpoint was saved in

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def fused_projections(self) -> bool:
        """Phi-3 stores `qkv_proj` and `gate_up_proj` fused; the converter splits them."""
        return self.architecture == "Phi3ForCausalLM"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict` (lists back to tuples)."""
        rope = dict(d["rope"])
        for k in ("short_factor", "long_factor"):
            if rope.get(k) is not None:
                rope[k] = tuple(rope[k])
        fields = dict(d, rope=RopeConfig(**rope), eos_token_ids=tuple(d.get("eos_token_ids", ())))
        return cls(**fields)


def read_hf_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json in {path}: a Hugging Face checkpoint directory needs one")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    return config_from_hf_dict(raw, source=str(file))


def config_from_hf_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed HF config dict (4.x or 5.x layout)."""
    archs = raw.get("architectures") or []
    if len(archs) != 1:
        raise ConfigError(f"{source}: expected one entry in 'architectures', got {archs!r}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{source}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    _refuse_unsupported(raw, arch, source)

    def need(key: str):
        if raw.get(key) is None:
            raise ConfigError(f"{source}: missing required field {key!r}")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_read_rope(raw, source),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch != "Phi3ForCausalLM")),
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
        checkpoint_dtype=str(dtype),
    )


def _refuse_unsupported(raw: dict[str, Any], arch: str, source: str) -> None:
    def refuse(what: str):
        raise ConfigError(f"{source}: {arch} with {what} is not supported by randkv_jax")

    for moe_key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(moe_key):
            refuse(f"mixture of experts ({moe_key}={raw[moe_key]})")
    for bias_key in ("attention_bias", "mlp_bias"):
        if raw.get(bias_key):
            refuse(f"biases ({bias_key}=true)")
    if raw.get("use_sliding_window"):
        refuse("sliding-window attention (use_sliding_window=true)")
    if arch != "Qwen3ForCausalLM" and raw.get("sliding_window") is not None:
        # Qwen3 keeps a `sliding_window` value that only applies when use_sliding_window is set.
        refuse(f"sliding-window attention (sliding_window={raw['sliding_window']})")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        refuse(f"layer types other than full_attention ({sorted(set(layer_types))})")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        refuse(f"hidden_act={act!r} (only silu)")


def _read_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    """Read RoPE settings from `rope_parameters` (5.x) or `rope_theta`/`rope_scaling` (4.x)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: no rope_theta (neither top-level nor in rope_parameters)")
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in ("su", "yarn") and raw.get("architectures", [""])[0] == "Phi3ForCausalLM":
        rope_type = "longrope"  # legacy Phi-3 names, as transformers maps them
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    original_max = merged.get(
        "original_max_position_embeddings", raw.get("original_max_position_embeddings")
    )

    def floats(key):
        v = merged.get(key)
        return None if v is None else tuple(float(x) for x in v)

    rope = RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        partial_rotary_factor=float(partial),
        factor=None if merged.get("factor") is None else float(merged["factor"]),
        original_max_position_embeddings=None if original_max is None else int(original_max),
        short_factor=floats("short_factor"),
        long_factor=floats("long_factor"),
        attention_factor=merged.get("attention_factor"),
        low_freq_factor=merged.get("low_freq_factor"),
        high_freq_factor=merged.get("high_freq_factor"),
        beta_fast=merged.get("beta_fast"),
        beta_slow=merged.get("beta_slow"),
        truncate=bool(merged.get("truncate", True)),
    )
    _check_rope(rope, raw, source)
    return rope


def _check_rope(rope: RopeConfig, raw: dict[str, Any], source: str) -> None:
    needs = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor",),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    }.get(rope.rope_type, ())
    for field in needs:
        if getattr(rope, field) is None:
            raise ConfigError(f"{source}: RoPE type {rope.rope_type!r} needs {field!r}")
    if rope.rope_type == "longrope":
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        half = int((raw.get("head_dim") or hidden // heads) * rope.partial_rotary_factor) // 2
        for name in ("short_factor", "long_factor"):
            if len(getattr(rope, name)) != half:
                raise ConfigError(
                    f"{source}: longrope {name} has {len(getattr(rope, name))} entries, "
                    f"expected rotary_dim/2 = {half}"
                )
    if not (0.0 < rope.partial_rotary_factor <= 1.0) or math.isnan(rope.partial_rotary_factor):
        raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1]")
