"""`Model` (config + parameters + tokenizer) and the cache-free forward pass."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
from randkv_jax.models.config import ModelConfig
from randkv_jax.models.decoder import Decoder, DenseInputs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_dtype(platform: str | None = None) -> str:
    """The dtype used when none is asked for: "bfloat16" on GPU and TPU, "float32" on CPU.

    On CPU, XLA's bfloat16 decode is not yet at least as fast as float32 everywhere (SmolLM2-135M,
    batch 8, prompt 128: 0.94x at 64 new tokens, 1.03-1.13x at 512; 5-10x slower before the
    whole-array converts were removed, `models/bits.py`; `docs/benchmarks.md`), and its prefill
    widens the weights to float32. `platform` defaults to JAX's default backend."""
    return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"


def resolve_dtype(dtype: str | Any | None) -> Any:
    """'float32' | 'bfloat16' (or the jnp dtype itself; None: `default_dtype()`) -> jnp dtype;
    anything else is refused."""
    if dtype is None:
        dtype = default_dtype()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in {jnp.dtype(d) for d in DTYPES.values()}:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return jnp.dtype(dtype).type


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded decoder: `params` is the Linen parameter tree (`{"params": ...}` inner dict)."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None  # randkv_jax.models.tokenizer.Tokenizer, or None (token ids only)
    dtype: Any = jnp.bfloat16  # compute dtype; parameters are stored in it too

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.params))


def init_params(config: ModelConfig, rng: jax.Array, dtype: Any = jnp.float32) -> Any:
    """Random parameters (normal(0.02) weights, unit norms) for `config`."""
    decoder = Decoder(config, dtype=dtype, param_dtype=dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return decoder.init(rng, tokens, tokens, DenseInputs(jnp.ones((1, 1, 1), bool)))["params"]


def abstract_params(config: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """The parameter tree as `jax.ShapeDtypeStruct`s: shapes without allocating memory."""
    return jax.eval_shape(functools.partial(init_params, config, dtype=dtype), jax.random.key(0))


def positions_from_mask(attention_mask: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """Token positions that skip padding: 0 at each row's first real token (left or right pad)."""
    return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _forward(params, tokens, attention_mask, *, config, dtype):
    attention_mask = attention_mask.astype(bool)
    t = tokens.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    mask = causal[None] & attention_mask[:, None, :]
    decoder = Decoder(config, dtype=dtype, param_dtype=dtype)
    logits, _ = decoder.apply({"params": params}, tokens, positions_from_mask(attention_mask), DenseInputs(mask))
    return logits


def forward(
    model: Model,
    tokens: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t v"]:
    """Logits [b, t, v] (float32) for every position, without a KV cache.

    `attention_mask` (1 = token, 0 = padding; left or right padding) defaults to all ones.
    Positions count real tokens only, so a left-padded row is computed as if unpadded.
    Logits at padded positions are meaningless.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    if attention_mask is None:
        attention_mask = jnp.ones_like(tokens)
    attention_mask = jnp.asarray(attention_mask)
    if attention_mask.shape != tokens.shape:
        raise ValueError(
            f"attention_mask shape {attention_mask.shape} does not match tokens {tokens.shape}"
        )
    return _forward(model.params, tokens, attention_mask, config=model.config, dtype=model.dtype)
