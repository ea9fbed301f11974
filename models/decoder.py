"""The one decoder: Qwen3, Phi-3/Phi-4 and Llama differ only through `ModelConfig`.

Why Flax Linen (not NNX): the decoder is run inside jitted loops (`lax.while_loop`) whose state
is donated, so parameters and the KV buffer must be plain pytrees passed in and out, never
objects mutated in place. Linen's `apply(params, ...)` is exactly that pure-function contract,
its parameter tree is a nested dict that Orbax, the converters and sharding rules address by
path, and `nn.scan` stacks the layers so compile time does not grow with depth.

What a layer differs by (all read from the config):
- Qwen3: per-head RMSNorm on q and k (`q_norm`, `k_norm`) before RoPE; explicit head_dim.
- Phi-3: partial rotary (`rotary_dim < head_dim`), longrope; fused weights are split at conversion.
- Tied embeddings: the logits reuse `embed.embedding`; otherwise a separate `lm_head`.

Attention itself is pluggable (`attend`, an `Attend`): the forward pass uses dense causal
attention over the tokens it is given (`causal_attend`); the generation loop passes functions
that write into and read from its KV buffer (`randkv_jax.decode`), calibration one that records
queries. Each caller types its two pytrees: `inputs`, given to every layer unchanged (masks,
positions, slots), and `cache`, carried through the layers and returned (a KV buffer, query
sums, or None). Einsum letters, used everywhere:
  b batch, t query time, s key slot, e embed, h query heads, k kv heads, g query heads per kv
  head, d head dim, r rotary dim, f mlp hidden, v vocab, l layers.
Parameter tree (shapes; `l` is the leading axis of everything under `layers`):
  embed/embedding [v, e]           layers/attn/q_proj [l, e, h, d]   layers/attn/o_proj [l, h, d, e]
  layers/attn/k_proj [l, e, k, d]  layers/attn/v_proj [l, e, k, d]   layers/attn/{q,k}_norm [l, d]
  layers/attn_norm/scale [l, e]    layers/mlp_norm/scale [l, e]      layers/mlp/{gate,up}_proj [l, e, f]
  layers/mlp/down_proj [l, f, e]   final_norm/scale [e]              lm_head [e, v] (untied only)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int
from randkv_jax.models.bits import moved_as_bits
from randkv_jax.models.config import ModelConfig
from randkv_jax.models.rope import apply_rope, rope_angles

Inputs = TypeVar("Inputs", contravariant=True)
Cache = TypeVar("Cache")


class Attend(Protocol[Inputs, Cache]):
    """Attention of one layer, as the decoder calls it.

    q [b, t, h, d] and k, v [b, t, k, d] are this call's tokens (after q/k norm and RoPE);
    `inputs` is the caller's per-call pytree (the same for every layer); `cache` the pytree carried
    through the layers (leaves with a leading layer axis are updated at `layer`). Returns the
    context [b, t, h, d] and the updated cache.
    """

    def __call__(
        self,
        q: Float[Array, "b t h d"],
        k: Float[Array, "b t k d"],
        v: Float[Array, "b t k d"],
        inputs: Inputs,
        cache: Cache,
        layer: Int[Array, ""],
    ) -> tuple[Float[Array, "b t h d"], Cache]: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseInputs:
    """`causal_attend`'s inputs."""

    mask: Bool[Array, "b t s"]
    """Query t sees key s (causal and padding)."""

_init = nn.initializers.normal(stddev=0.02)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as transformers computes it: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def dense_attention(
    q: Float[Array, "b t h d"], k: Float[Array, "b s k d"], v: Float[Array, "b s k d"], mask: Bool[Array, "b t s"]
) -> Float[Array, "b t h d"]:
    """Softmax attention of q over k, v where `mask` allows (float32 scores and softmax)."""
    b, t, h, d = q.shape
    groups = h // k.shape[2]
    qg = q.reshape(b, t, k.shape[2], groups, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    ctx = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return ctx.reshape(b, t, h, d).astype(q.dtype)


def causal_attend(q, k, v, inputs: DenseInputs, cache: Any = None, layer=None):
    """The forward pass's `Attend`: dense attention over the call's own tokens; the cache passes through."""
    return dense_attention(q, k, v, inputs.mask), cache


class RMSNorm(nn.Module):
    eps: float
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps)


class EmbeddingTable(nn.Module):
    """Holds `embedding` [v, e]; returns the table (lookup and tied logits both use it)."""

    vocab_size: int
    hidden_size: int
    param_dtype: Any

    @nn.compact
    def __call__(self):
        return self.param("embedding", _init, (self.vocab_size, self.hidden_size), self.param_dtype)


def project(subscripts: str, x: Array, w: Array) -> Array:
    """A projection `einsum(subscripts, x, w)` accumulated in float32, returned in `x.dtype`.

    Without `preferred_element_type`, XLA:CPU runs a bfloat16 dot by converting both operands,
    the whole weight matrix included, to float32 every call (60 SmolLM2-sized bf16 matmuls at
    batch 8: 129 ms against 13 ms with float32 accumulation, 17 ms in float32); GPUs and TPUs
    accumulate bf16 dots in float32 anyway."""
    return jnp.einsum(subscripts, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    attend: Attend
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, inputs, cache, layer):
        c = self.config
        e, h, k, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

        def weight(name, shape):
            return self.param(name, _init, shape, self.param_dtype).astype(self.dtype)

        with jax.named_scope("qkv"):
            q = project("bte,ehd->bthd", x, weight("q_proj", (e, h, d)))
            key = project("bte,ekd->btkd", x, weight("k_proj", (e, k, d)))
            value = project("bte,ekd->btkd", x, weight("v_proj", (e, k, d)))
            if c.qk_norm:
                q_scale = self.param("q_norm", nn.initializers.ones, (d,), self.param_dtype)
                k_scale = self.param("k_norm", nn.initializers.ones, (d,), self.param_dtype)
                q = rms_norm(q, q_scale, c.rms_norm_eps)
                key = rms_norm(key, k_scale, c.rms_norm_eps)
            q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        with jax.named_scope("attend"):
            ctx, cache = self.attend(q, key, value, inputs, cache, layer)
        with jax.named_scope("out_proj"):
            out = project("bthd,hde->bte", ctx, weight("o_proj", (h, d, e)))
        return out, cache


class MLP(nn.Module):
    config: ModelConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        e, f = self.config.hidden_size, self.config.intermediate_size

        def weight(name, shape):
            return self.param(name, _init, shape, self.param_dtype).astype(self.dtype)

        gate = project("bte,ef->btf", x, weight("gate_proj", (e, f)))
        up = project("bte,ef->btf", x, weight("up_proj", (e, f)))
        return project("btf,fe->bte", jax.nn.silu(gate) * up, weight("down_proj", (f, e)))


class DecoderLayer(nn.Module):
    config: ModelConfig
    attend: Attend
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, carry, cos, sin, inputs):
        x, cache, layer = carry
        c = self.config
        with jax.named_scope("attention"):
            h = RMSNorm(c.rms_norm_eps, self.param_dtype, name="attn_norm")(x)
            h, cache = Attention(c, self.attend, self.dtype, self.param_dtype, name="attn")(
                h, cos, sin, inputs, cache, layer
            )
            x = x + h
        with jax.named_scope("mlp"):
            h = RMSNorm(c.rms_norm_eps, self.param_dtype, name="mlp_norm")(x)
            x = x + MLP(c, self.dtype, self.param_dtype, name="mlp")(h)
        return (x, cache, layer + 1), None


def unstack_layers(params: Any) -> Any:
    """The parameter tree for `Decoder(unstacked=True)`: `layers` [l, ...] split into
    `layers_0` .. `layers_{l-1}` (separate device buffers; a copy of the layer weights)."""
    params = dict(params)
    stacked = params.pop("layers")
    count = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(count):
        params[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
    return params


class Decoder(nn.Module):
    """Token ids -> float32 logits. Layers are stacked on a leading axis and scanned.

    `cache` (e.g. the generation loop's KV buffer, leaves with a leading `l` axis) is carried
    through the layers whole: layer i's `attend` gets it with `layer=i` and updates its slice in
    place, so no layer copies the buffer; `inputs` is given to every layer as is. `logit_index`
    ([b] ints) computes logits only at one position per row (prefill of a generation), else at
    every position.
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attend: Attend = causal_attend
    unstacked: bool = False
    """Layers as separate parameter trees `layers_0` .. `layers_{l-1}` (`unstack_layers`), run by
    an unrolled Python loop instead of `nn.scan`: each layer's matmuls read its own buffers, where
    the scan first copies its slice of the stacked weights (XLA:CPU does not fuse a
    `dynamic-slice` into a dot; that copy cost 24 of 53 ms per step, SmolLM2-135M, batch 8)."""

    @nn.compact
    def __call__(
        self,
        tokens: Int[Array, "b t"],
        positions: Int[Array, "b t"],
        inputs: Any,
        cache: Any = None,
        logit_index: Int[Array, " b"] | None = None,
    ):
        c = self.config
        embedding = EmbeddingTable(c.vocab_size, c.hidden_size, self.param_dtype, name="embed")()
        x = moved_as_bits(lambda table: jnp.take(table, tokens, axis=0), embedding).astype(self.dtype)
        cos, sin = rope_angles(c, positions)
        if self.unstacked:
            for i in range(c.num_layers):
                layer = DecoderLayer(c, self.attend, self.dtype, self.param_dtype, name=f"layers_{i}")
                (x, cache, _), _ = layer((x, cache, jnp.int32(i)), cos, sin, inputs)
        else:
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=c.num_layers,
            )(c, self.attend, self.dtype, self.param_dtype, name="layers")
            (x, cache, _), _ = layers((x, cache, jnp.int32(0)), cos, sin, inputs)
        x = RMSNorm(c.rms_norm_eps, self.param_dtype, name="final_norm")(x)
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]
        with jax.named_scope("logits"):
            if c.tie_word_embeddings:
                head = embedding.astype(self.dtype).T
            else:
                head = self.param("lm_head", _init, (c.hidden_size, c.vocab_size), self.param_dtype)
                head = head.astype(self.dtype)
            logits = jnp.einsum("...e,ev->...v", x, head, preferred_element_type=jnp.float32)
        return logits, cache

