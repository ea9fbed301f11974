"""Prefill, the jitted decode loop, and eviction inside it.

    state = prefill(...)              # prompt -> KVBuffer, first token sampled
    while not finished(state):        # host loop over chunks of `chunk` tokens (progress, early exit)
        state = decode_chunk(...)     # lax.while_loop over tokens, state donated

Each decode step feeds every row's last token at its true position, appends its key/value at slot
`fill` of every layer, attends over the filled blocks of the buffer, samples the next token, and,
every r generated tokens, runs an eviction round (`lax.cond`, only when some row is due):
the policy's keep-mask, then `buffer.compact`. Nothing in the step depends on Python values
that change per token, so a (batch, capacity, policy) shape compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from randkv_jax.attention import buffer_attention
from randkv_jax.buffer import KVBuffer, compact, compaction_order
from randkv_jax.models.config import ModelConfig
from randkv_jax.models.decoder import Decoder, causal_attend
from randkv_jax.observations import Observations, record_decode, record_prefill, reorder
from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.sampling import SamplingParams, sample_tokens

ATTENTION_BLOCK = 128  # slots per block of decode attention; capacities are rounded up to it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """Everything the decode loop carries (donated between chunks)."""

    buffer: KVBuffer
    """The KV cache."""
    tokens: Int[Array, "b n"]
    """Generated ids, n = max_new_tokens; `pad_id` after a row has stopped."""
    last: Int[Array, " b"]
    """The newest token of each row: the next step's input."""
    step: Int[Array, ""]
    """Generated tokens already written to the buffer (= decode steps run)."""
    n_new: Int[Array, " b"]
    """Tokens generated per row, its stop token included."""
    done: Bool[Array, " b"]
    """Row has produced a stop token or max_new_tokens."""
    evictions: Int[Array, " b"]
    """Eviction rounds that removed entries from the row."""
    peak_slots: Int[Array, " b"]
    """Most valid slots held by any layer and head of the row."""
    row_seeds: Int[Array, " b"]
    """Per-request seeds (sampling keys and eviction draws derive from these)."""
    observations: Observations | None
    """What a scoring policy records (recent queries, accumulated attention); None otherwise."""


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """The static settings of one compiled decode program (hashable)."""

    config: ModelConfig
    dtype: Any
    policy: Any
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int

    @property
    def evicts(self) -> bool:
        return isinstance(self.policy, EvictionPolicy)

    def observations(self, batch: int, capacity: int) -> Observations | None:
        if not self.evicts:
            return None
        return Observations.create(self.policy.needs, self.config, batch, capacity, self.dtype)


def padded_capacity(policy, prompt_len: int, max_new_tokens: int) -> int:
    """Buffer capacity for `policy`, rounded up to whole attention blocks."""
    need = policy.capacity(prompt_len, max_new_tokens)
    return -(-need // ATTENTION_BLOCK) * ATTENTION_BLOCK


def _prefill_attend(q, k, v, shared, state, layer):
    """Dense causal attention over the prompt, writing its keys/values to slots [0, t)."""
    mask, token_positions = shared
    ctx, _ = causal_attend(q, k, v, mask)
    keys, values, positions, observations = state
    observations = record_prefill(observations, layer, q, k, token_positions)
    t = k.shape[1]
    write = lambda buf, x: jax.lax.dynamic_update_slice(  # noqa: E731
        buf, x.transpose(0, 2, 1, 3)[None].astype(buf.dtype), (layer, 0, 0, 0, 0)
    )
    keys, values = write(keys, k), write(values, v)
    heads = positions.shape[2]
    pos = jnp.broadcast_to(token_positions[:, None, :], (k.shape[0], heads, t))[None]
    positions = jax.lax.dynamic_update_slice(positions, pos, (layer, 0, 0, 0))
    return ctx, (keys, values, positions, observations)


def _decode_attend(q, k, v, shared, state, layer):
    """Append this step's key/value at each row's `slot`, then attend over the filled blocks."""
    slot, new_pos, n_filled, step = shared
    keys, values, positions, observations = state
    rows = jnp.arange(k.shape[0])
    keys = keys.at[layer, rows, :, slot].set(k[:, 0].astype(keys.dtype))
    values = values.at[layer, rows, :, slot].set(v[:, 0].astype(values.dtype))
    positions = positions.at[layer, rows, :, slot].set(new_pos[:, None])
    ctx = buffer_attention(
        q, keys, values, positions, new_pos[:, None], n_filled, block_size=ATTENTION_BLOCK, layer=layer
    )
    observations = record_decode(observations, layer, step, q, keys, positions, new_pos[:, None])
    return ctx, (keys, values, positions, observations)


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
    mask = jnp.tril(jnp.ones((p, p), bool))[None] & valid[:, None, :]
    buffer = KVBuffer.empty(spec.config, b, capacity, spec.dtype)
    decoder = Decoder(spec.config, spec.dtype, spec.dtype, attend=_prefill_attend)
    logits, (keys, values, positions, observations) = decoder.apply(
        {"params": params}, prompts, jnp.maximum(token_positions, 0), (mask, token_positions),
        (buffer.keys, buffer.values, buffer.positions, spec.observations(b, capacity)),
        logit_index=prompt_lens - 1,
    )
    buffer = dataclasses.replace(
        buffer, keys=keys, values=values, positions=positions, prompt_lens=prompt_lens, fill=prompt_lens
    )
    first = sample_tokens(logits, _row_keys(row_seeds), jnp.int32(0), spec.sampling)
    done = _is_stop(first, spec) | (spec.max_new_tokens <= 1)
    tokens = jnp.full((b, spec.max_new_tokens), spec.pad_id, jnp.int32).at[:, 0].set(first)
    zeros = jnp.zeros((b,), jnp.int32)
    return LoopState(
        buffer=buffer, tokens=tokens, last=first, step=jnp.int32(0), n_new=zeros + 1, done=done,
        evictions=zeros, peak_slots=prompt_lens, row_seeds=row_seeds, observations=observations,
    )


def _is_stop(tokens, spec: DecodeSpec):
    return jnp.isin(tokens, jnp.asarray(spec.stop_ids, jnp.int32)) if spec.stop_ids else jnp.zeros(tokens.shape, bool)


def finished(state: LoopState, spec: DecodeSpec) -> Bool[Array, ""]:
    return jnp.all(state.done) | (state.step >= spec.max_new_tokens - 1)


def _step(params, state: LoopState, spec: DecodeSpec) -> LoopState:
    buffer = state.buffer
    new_pos = buffer.prompt_lens + state.step  # the true position of `last`
    n_filled = jnp.max(buffer.fill) + 1
    decoder = Decoder(spec.config, spec.dtype, spec.dtype, attend=_decode_attend)
    logits, (keys, values, positions, observations) = decoder.apply(
        {"params": params}, state.last[:, None], new_pos[:, None], (buffer.fill, new_pos, n_filled, state.step),
        (buffer.keys, buffer.values, buffer.positions, state.observations),
    )
    buffer = dataclasses.replace(buffer, keys=keys, values=values, positions=positions, fill=buffer.fill + 1)
    step = state.step + 1
    peak_slots = jnp.where(state.done, state.peak_slots, jnp.maximum(state.peak_slots, buffer.fill))
    evictions = state.evictions
    if spec.evicts:
        with jax.named_scope("eviction"):
            due = spec.policy.due(buffer, step)
            buffer, observations = jax.lax.cond(
                jnp.any(due),
                lambda buf, obs: _evict(spec.policy, buf, obs, step, state.row_seeds),
                lambda buf, obs: (buf, obs),
                buffer, observations,
            )
            evictions = evictions + (due & ~state.done)
    token = sample_tokens(logits[:, 0], _row_keys(state.row_seeds), step, spec.sampling)
    token = jnp.where(state.done, spec.pad_id, token)
    n_new = state.n_new + ~state.done
    done = state.done | _is_stop(token, spec) | (n_new >= spec.max_new_tokens)
    return dataclasses.replace(
        state, buffer=buffer, tokens=state.tokens.at[:, step].set(token), last=token, step=step,
        n_new=n_new, done=done, evictions=evictions, peak_slots=peak_slots, observations=observations,
    )


def _evict(policy: EvictionPolicy, buffer: KVBuffer, observations, step, row_seeds):
    """One eviction round: the policy's keep-mask, then compaction of the buffer (and of what
    the policy observed per slot)."""
    keep = policy.keep_mask(buffer, step, row_seeds, observations) & buffer.valid
    return compact(buffer, keep), reorder(observations, compaction_order(keep), keep)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_chunk(params, state: LoopState, max_steps: Int[Array, ""], *, spec: DecodeSpec) -> LoopState:
    """Up to `max_steps` decode steps (fewer once every row is done or max_new_tokens is hit)."""
    stop_at = state.step + max_steps

    def cond(s):
        return ~finished(s, spec) & (s.step < stop_at)

    return jax.lax.while_loop(cond, lambda s: _step(params, s, spec), state)
