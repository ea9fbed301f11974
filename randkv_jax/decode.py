"""Prefill, the jitted decode loop, and eviction inside it.

    state = prefill(...)              # prompt -> KVBuffer, first token sampled
    while not all(state.done):        # host loop over chunks of `chunk` tokens (progress, early exit)
        state = decode_chunk(...)     # lax.while_loop over tokens, state donated

Each decode step feeds every row's last token at its true position (`prompt_lens + generated`),
appends its key/value at slot `fill` of every layer, attends over the filled blocks of the
buffer, then runs an eviction round (`lax.cond`, only when some row is due: its own generated
count a multiple of the policy's interval and more than its budget held): the policy's
keep-mask, then `buffer.compact`; and samples the next token. Nothing in the step depends on
Python values that change per token, so a (batch, capacity, policy) shape compiles once.

The model-loop seam is typed: the decoder calls `Attend` functions with `PrefillInputs` or
`DecodeInputs` (the same for every layer) and carries a `CacheState` (the buffer and what the
policy observes) through the layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from randkv_jax.attention import buffer_attention
from randkv_jax.buffer import KVBuffer, compact
from randkv_jax.models.config import ModelConfig
from randkv_jax.models.decoder import Decoder, dense_attention
from randkv_jax.observations import Observations, record_decode, record_prefill, reorder
from randkv_jax.policies.base import PLATFORMS, Policy
from randkv_jax.sampling import SamplingParams, sample_tokens

ATTENTION_BLOCK = 128  # slots per block of decode attention; capacities are rounded up to it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
    """The generation loop's `Attend` cache: what every layer's attention reads and writes."""

    buffer: KVBuffer
    """The KV cache (each layer writes its slice)."""
    observations: Observations | None
    """What the policy records per layer (recent queries, accumulated attention); None if nothing."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """Prefill's `Attend` inputs (right-padded prompts [b, t])."""

    mask: Bool[Array, "b t t"]
    """Causal mask, padding keys masked out."""
    token_positions: Int[Array, "b t"]
    """Position of each prompt token; -1 for padding."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """A decode step's `Attend` inputs (one new token per row; it is written at slot `fill`)."""

    query_positions: Int[Array, " b"]
    """True position of each row's new token: prompt_lens + generated."""
    n_filled: Int[Array, ""]
    """Slots attention reads: the largest fill after the append."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """Everything the decode loop carries (donated between chunks)."""

    buffer: KVBuffer
    """The KV cache; its `generated` [b] counts the tokens each row has written."""
    tokens: Int[Array, "b n"]
    """Generated ids, n = max_new_tokens; `pad_id` after a row has stopped."""
    last: Int[Array, " b"]
    """The newest token of each row: the next step's input."""
    n_new: Int[Array, " b"]
    """Tokens generated per row, its stop token included."""
    done: Bool[Array, " b"]
    """Row has produced a stop token or max_new_tokens."""
    evictions: Int[Array, " b"]
    """Eviction rounds run on the row while it was generating."""
    peak_slots: Int[Array, " b"]
    """Most entries any layer and head of the row held while it was generating."""
    held_after_round: Int[Array, " b"]
    """Entries each layer and head of the row held right after its last round (0: no round yet)."""
    row_seeds: Int[Array, " b"]
    """Per-request seeds (sampling keys and eviction draws derive from these)."""
    observations: Observations | None
    """What a scoring policy records (recent queries, accumulated attention); None otherwise."""


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """The static settings of one compiled decode program (hashable)."""

    config: ModelConfig
    dtype: Any
    policy: Policy
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    platform: str
    """JAX platform the program is built for ("cpu", "gpu", "tpu"): picks the eviction kernel
    (Pallas or XLA) and the CPU slicing workaround of `buffer_attention`, once, before tracing."""

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")

    def observations(self, batch: int, capacity: int) -> Observations | None:
        return Observations.create(self.policy.needs, self.config, batch, capacity, self.dtype)


def platform_of(params: Any) -> str:
    """The JAX platform the parameters live on ("cpu", "gpu" or "tpu")."""
    return next(iter(jax.tree.leaves(params)[0].devices())).platform


def padded_capacity(policy: Policy, prompt_len: int, max_new_tokens: int) -> int:
    """Buffer capacity for `policy`, rounded up to whole attention blocks."""
    need = policy.capacity(prompt_len, max_new_tokens)
    return -(-need // ATTENTION_BLOCK) * ATTENTION_BLOCK


def _prefill_attend(q, k, v, inputs: PrefillInputs, cache: CacheState, layer):
    """Dense causal attention over the prompt, writing its keys/values to slots [0, t)."""
    ctx = dense_attention(q, k, v, inputs.mask)
    buf = cache.buffer
    t = k.shape[1]
    write = lambda dest, x: jax.lax.dynamic_update_slice(  # noqa: E731
        dest, x.transpose(0, 2, 1, 3)[None].astype(dest.dtype), (layer, 0, 0, 0, 0)
    )
    heads = buf.positions.shape[2]
    pos = jnp.broadcast_to(inputs.token_positions[:, None, :], (k.shape[0], heads, t))[None]
    buf = dataclasses.replace(
        buf, keys=write(buf.keys, k), values=write(buf.values, v),
        positions=jax.lax.dynamic_update_slice(buf.positions, pos, (layer, 0, 0, 0)),
    )
    observations = record_prefill(cache.observations, layer, q, k, inputs.token_positions)
    return ctx, CacheState(buf, observations)


def _decode_attend(q, k, v, inputs: DecodeInputs, cache: CacheState, layer, *, slice_as_bits: bool):
    """Append this step's key/value at each row's slot `fill`, then attend over the filled blocks."""
    buf = cache.buffer
    rows, slot = jnp.arange(k.shape[0]), buf.fill
    buf = dataclasses.replace(
        buf,
        keys=buf.keys.at[layer, rows, :, slot].set(k[:, 0].astype(buf.keys.dtype)),
        values=buf.values.at[layer, rows, :, slot].set(v[:, 0].astype(buf.values.dtype)),
        positions=buf.positions.at[layer, rows, :, slot].set(inputs.query_positions[:, None]),
    )
    query_positions = inputs.query_positions[:, None]
    ctx = buffer_attention(
        q, buf.keys, buf.values, buf.positions, query_positions, inputs.n_filled,
        block_size=ATTENTION_BLOCK, layer=layer, slice_as_bits=slice_as_bits,
    )
    observations = record_decode(cache.observations, layer, buf.generated, q, buf.keys, buf.positions,
                                 query_positions)
    return ctx, CacheState(buf, observations)


def _row_keys(row_seeds):
    return jax.vmap(jax.random.key)(row_seeds)


@functools.partial(jax.jit, static_argnames=("spec", "capacity"))
def prefill(params, prompts, prompt_lens, row_seeds, *, spec: DecodeSpec, capacity: int) -> LoopState:
    """Run the prompt, fill the buffer, sample the first token.

    prompts [b, p] right-padded token ids; prompt_lens [b]; row_seeds [b].
    """
    b, p = prompts.shape
    valid = jnp.arange(p)[None, :] < prompt_lens[:, None]
    token_positions = jnp.where(valid, jnp.arange(p)[None, :], -1).astype(jnp.int32)
    inputs = PrefillInputs(mask=jnp.tril(jnp.ones((p, p), bool))[None] & valid[:, None, :],
                           token_positions=token_positions)
    cache = CacheState(KVBuffer.empty(spec.config, b, capacity, spec.dtype), spec.observations(b, capacity))
    decoder = Decoder(spec.config, spec.dtype, spec.dtype, attend=_prefill_attend)
    logits, cache = decoder.apply(
        {"params": params}, prompts, jnp.maximum(token_positions, 0), inputs, cache, logit_index=prompt_lens - 1,
    )
    buffer = dataclasses.replace(cache.buffer, prompt_lens=prompt_lens, fill=prompt_lens)
    zeros = jnp.zeros((b,), jnp.int32)
    first = sample_tokens(logits, _row_keys(row_seeds), zeros, spec.sampling)
    done = _is_stop(first, spec) | (spec.max_new_tokens <= 1)
    tokens = jnp.full((b, spec.max_new_tokens), spec.pad_id, jnp.int32).at[:, 0].set(first)
    return LoopState(
        buffer=buffer, tokens=tokens, last=first, n_new=zeros + 1, done=done, evictions=zeros,
        peak_slots=prompt_lens, held_after_round=zeros, row_seeds=row_seeds, observations=cache.observations,
    )


def _is_stop(tokens, spec: DecodeSpec):
    return jnp.isin(tokens, jnp.asarray(spec.stop_ids, jnp.int32)) if spec.stop_ids else jnp.zeros(tokens.shape, bool)


def _step(params, state: LoopState, spec: DecodeSpec) -> LoopState:
    buffer = state.buffer
    inputs = DecodeInputs(query_positions=buffer.prompt_lens + buffer.generated, n_filled=jnp.max(buffer.fill) + 1)
    attend = functools.partial(_decode_attend, slice_as_bits=spec.platform == "cpu")
    decoder = Decoder(spec.config, spec.dtype, spec.dtype, attend=attend)
    logits, cache = decoder.apply(
        {"params": params}, state.last[:, None], inputs.query_positions[:, None], inputs,
        CacheState(buffer, state.observations),
    )
    buffer = dataclasses.replace(cache.buffer, fill=buffer.fill + 1, generated=buffer.generated + 1)
    peak_slots = jnp.where(state.done, state.peak_slots, jnp.maximum(state.peak_slots, buffer.fill))
    with jax.named_scope("eviction"):
        due = spec.policy.due(buffer)
        buffer, observations = jax.lax.cond(
            jnp.any(due),
            functools.partial(_evict, spec),
            lambda buf, obs, seeds: (buf, obs),
            buffer, cache.observations, state.row_seeds,
        )
    counted = due & ~state.done
    token = sample_tokens(logits[:, 0], _row_keys(state.row_seeds), buffer.generated, spec.sampling)
    token = jnp.where(state.done, spec.pad_id, token)
    n_new = state.n_new + ~state.done
    rows = jnp.arange(token.shape[0])
    return dataclasses.replace(
        state, buffer=buffer, tokens=state.tokens.at[rows, buffer.generated].set(token, mode="drop"), last=token,
        n_new=n_new, done=state.done | _is_stop(token, spec) | (n_new >= spec.max_new_tokens),
        evictions=state.evictions + counted, peak_slots=peak_slots,
        held_after_round=jnp.where(counted, buffer.fill, state.held_after_round), observations=observations,
    )


def _evict(spec: DecodeSpec, buffer: KVBuffer, observations, row_seeds):
    """One eviction round: the policy's keep-mask, then compaction of the buffer (and of what
    the policy observed per slot)."""
    keep = spec.policy.keep_mask(buffer, row_seeds, observations, platform=spec.platform)
    buffer, order = compact(buffer, keep)
    return buffer, reorder(observations, order, buffer.valid)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_chunk(params, state: LoopState, max_steps: Int[Array, ""], *, spec: DecodeSpec) -> LoopState:
    """Up to `max_steps` decode steps (fewer once every row is done)."""

    def cond(carry):
        s, steps = carry
        return ~jnp.all(s.done) & (steps < max_steps)

    def body(carry):
        s, steps = carry
        return _step(params, s, spec), steps + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state
