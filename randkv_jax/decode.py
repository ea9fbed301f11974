"""The device side of generation: prefill, insert into a batch slot, the jitted decode loop.

    prompt = prefill(params, ids, lens, spec=...)          # one request's prompt -> Prefilled
    state = insert(state, prompt, 0, slot, seed, ...)      # into a free slot; first token sampled
    state = decode_chunk(params, state, steps, spec=...)   # lax.while_loop over steps, state donated

`randkv_jax.engine.Engine` drives these from the host (a request queue over fixed slots);
`generate` is the engine with one slot per prompt.

Each decode step feeds every active row's last token at its true position (`prompt_lens +
generated`), appends its key/value at slot `fill` of every layer, attends over the filled blocks
of the buffer and samples the next token with the row's key folded with its own count; after a
step at which some row is due (its own generated count a multiple of the policy's interval and
more than its budget held) an eviction round runs: the policy's keep-mask, then
`buffer.compact`. The loop is two nested `while_loop`s, steps until some row is due, then its
round, so the buffer is carried in place through the steps without one. Rows that are not active
(finished, cancelled, empty) are frozen: nothing they hold changes and nothing they compute is
kept. Nothing in the step depends on Python values that
change per token, so a (slots, capacity, policy) shape compiles once.

Teacher forcing (`DecodeSpec.forced` > 0, for the probes): a request's first tokens are fed
instead of sampled ones, through the same steps and eviction rounds, and every produced token's
log-probability and argmax flag are recorded (`LoopState.emitted_logprob`, `emitted_greedy`).

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
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from randkv_jax import buffer as kv_buffer
from randkv_jax import observations as obs_lib
from randkv_jax import sharding
from randkv_jax.attention import buffer_attention
from randkv_jax.buffer import KVBuffer, compact
from randkv_jax.models.bits import from_bits, is_half, moved_as_bits, to_bits
from randkv_jax.models.config import ModelConfig
from randkv_jax.models.decoder import Decoder, dense_attention
from randkv_jax.observations import Observations, record_decode, record_prefill, reorder
from randkv_jax.policies.base import PLATFORMS, Policy
from randkv_jax.sampling import SamplingParams, sample_tokens

ATTENTION_BLOCK = 128  # slots per block of decode attention; capacities are rounded up to it
MAX_STOP_IDS = 16  # stop tokens per request (the model's EOS ids included)


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
    active: Bool[Array, " b"]
    """Rows generating this step; the others write nothing visible (their new slot stays empty)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
    """Prompts run through the model: what `insert` puts into a batch slot (t = the prompt bucket)."""

    buffer: KVBuffer
    """The prompts' keys and values, t slots per row (prompt_lens and fill set, generated 0)."""
    observations: Observations | None
    """What the policy records during the prompt (accumulated attention), t slots per row."""
    logits: Float[Array, "p v"]
    """float32 logits at each prompt's last token: the first token is sampled from them."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """Everything the decode loop carries for its fixed batch of slots (donated between calls).

    A slot is either active (a request generating) or not (empty, finished or cancelled).
    """

    buffer: KVBuffer
    """The KV cache; its `generated` [b] counts the tokens each row has written."""
    last: Int[Array, " b"]
    """The newest token of each row: the next step's input."""
    active: Bool[Array, " b"]
    """Row is generating: inserted, no stop token yet, fewer than its max_new tokens."""
    n_new: Int[Array, " b"]
    """Tokens generated per row, the prefill's first token and the stop token included."""
    max_new: Int[Array, " b"]
    """Each request's max_new_tokens."""
    stop_ids: Int[Array, "b m"]
    """Each request's stop tokens, -1 padded (m = MAX_STOP_IDS)."""
    emitted: Int[Array, "b c"]
    """Tokens produced by the steps of the current `decode_chunk` call, -1 where a row was inactive
    (c = the spec's chunk)."""
    evictions: Int[Array, " b"]
    """Eviction rounds run on the row."""
    peak_slots: Int[Array, " b"]
    """Most entries any layer and head of the row held."""
    held_after_round: Int[Array, " b"]
    """Entries each layer and head of the row held right after its last round (0: no round yet)."""
    row_seeds: Int[Array, " b"]
    """Per-request seeds (sampling keys and eviction draws derive from these)."""
    rounds_run: Int[Array, ""]
    """Decode steps that ran an eviction round (for any row): the batched cost of eviction."""
    observations: Observations | None
    """What a scoring policy records (recent queries, accumulated attention); None otherwise."""
    forced: Int[Array, "b f"] | None = None
    """Teacher forcing (only when `DecodeSpec.forced` > 0): each row's first tokens, fed instead
    of sampled ones (-1 past a row's forced length; f = the spec's `forced`)."""
    emitted_logprob: Float[Array, "b c"] | None = None
    """With teacher forcing: the float32 log-probability the model gave each token in `emitted`."""
    emitted_greedy: Bool[Array, "b c"] | None = None
    """With teacher forcing: whether each token in `emitted` was the model's argmax (what greedy
    decoding would have produced)."""


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """The static settings of one compiled decode program (hashable)."""

    config: ModelConfig
    dtype: Any
    policy: Policy
    sampling: SamplingParams
    chunk: int
    """Most decode steps per `decode_chunk` call (the width of `LoopState.emitted`)."""
    platform: str
    """JAX platform the program is built for ("cpu", "gpu", "tpu"): picks the eviction kernel
    (Pallas or XLA) and the CPU slicing workaround of `buffer_attention`, once, before tracing."""
    mesh: Mesh | None = None
    """Devices the loop runs on (axes `data`, `model`; `randkv_jax.sharding`): the state's rows
    split over `data`, its KV heads over `model`, eviction rounds per shard. None: one device."""
    forced: int = 0
    """Teacher forcing: the most tokens a request may force (0: none; `LoopState.forced`)."""
    unstacked: bool = False
    """`decode_chunk` takes `unstack_layers(params)` and runs the layers unrolled
    (`Decoder.unstacked`); the engine sets it on CPU. `prefill` always takes the stacked tree."""

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {self.chunk!r}")
        if not isinstance(self.forced, int) or self.forced < 0:
            raise ValueError(f"forced must be a non-negative integer, got {self.forced!r}")
        if self.mesh is not None:
            sharding.check_mesh(self.mesh)
            sharding.check_policy(self.policy, self.config, self.mesh)

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
    write = lambda dest, x: moved_as_bits(  # noqa: E731
        lambda d, u: jax.lax.dynamic_update_slice(d, u.transpose(0, 2, 1, 3)[None], (layer, 0, 0, 0, 0)), dest, x)
    heads = buf.positions.shape[2]
    pos = jnp.broadcast_to(inputs.token_positions[:, None, :], (k.shape[0], heads, t))[None]
    buf = dataclasses.replace(
        buf, keys=write(buf.keys, k), values=write(buf.values, v),
        positions=jax.lax.dynamic_update_slice(buf.positions, pos, (layer, 0, 0, 0)),
    )
    observations = record_prefill(cache.observations, layer, q, k, inputs.token_positions)
    return ctx, CacheState(buf, observations)


def _decode_attend(q, k, v, inputs: DecodeInputs, cache: CacheState, layer, *, half_as_bits: bool):
    """Append this step's key/value at each row's slot `fill`, then attend over the filled blocks.

    The new slot's position is already written, for every layer at once (`_step`).
    `half_as_bits` (the CPU program): a 16-bit float buffer is appended to and read as its uint16
    bits (`models.bits`; XLA:CPU widens 16-bit scatters and slices to float32 over the whole
    buffer), the bits handed to the attention as they are: a bitcast back to floats in between
    would be materialised, a copy of the buffer per layer."""
    buf = cache.buffer
    rows, slot = jnp.arange(k.shape[0]), buf.fill
    dtype, half = buf.keys.dtype, is_half(buf.keys.dtype)
    stored = (lambda x: to_bits(x.astype(dtype))) if half else (lambda x: x.astype(dtype))  # noqa: E731
    append = lambda dest, x: stored(dest).at[layer, rows, :, slot].set(stored(x[:, 0]), mode="drop")  # noqa: E731
    keys, values = append(buf.keys, k), append(buf.values, v)  # the bits of a 16-bit buffer
    floats = lambda x: from_bits(x, dtype) if half else x  # noqa: E731
    bits_of = dtype if half and half_as_bits else None
    attended = (keys, values) if bits_of else (floats(keys), floats(values))
    query_positions = inputs.query_positions[:, None]
    ctx = buffer_attention(
        q, *attended, buf.positions, query_positions, inputs.n_filled,
        block_size=ATTENTION_BLOCK, layer=layer, bits_of=bits_of,
    )
    buf = dataclasses.replace(buf, keys=floats(keys), values=floats(values))
    observations = record_decode(cache.observations, layer, buf.generated, inputs.active, q, buf.keys,
                                 buf.positions, query_positions)
    return ctx, CacheState(buf, observations)


def _row_keys(row_seeds):
    return jax.vmap(jax.random.key)(row_seeds)


@functools.partial(jax.jit, static_argnames=("spec",))
def prefill(params, prompts: Int[Array, "p t"], prompt_lens: Int[Array, " p"], *, spec: DecodeSpec) -> Prefilled:
    """Run right-padded prompts [p, t] (t: the bucket) through the model: their KV entries at
    slots [0, t) of a t-slot buffer, what the policy observes, and the last token's logits."""
    p, t = prompts.shape
    valid = jnp.arange(t)[None, :] < prompt_lens[:, None]
    token_positions = jnp.where(valid, jnp.arange(t)[None, :], -1).astype(jnp.int32)
    inputs = PrefillInputs(mask=jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :],
                           token_positions=token_positions)
    cache = CacheState(KVBuffer.empty(spec.config, p, t, spec.dtype), spec.observations(p, t))
    decoder = Decoder(spec.config, spec.dtype, spec.dtype, attend=_prefill_attend)
    logits, cache = decoder.apply(
        {"params": params}, prompts, jnp.maximum(token_positions, 0), inputs, cache, logit_index=prompt_lens - 1,
    )
    return Prefilled(dataclasses.replace(cache.buffer, prompt_lens=prompt_lens, fill=prompt_lens),
                     cache.observations, logits)


def empty_state(spec: DecodeSpec, slots: int, capacity: int) -> LoopState:
    """A loop state of `slots` empty (inactive) rows of `capacity` slots each."""
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731  (distinct buffers: the state is donated)
    return LoopState(
        buffer=KVBuffer.empty(spec.config, slots, capacity, spec.dtype), last=zeros(),
        active=jnp.zeros((slots,), bool), n_new=zeros(), max_new=zeros(),
        stop_ids=jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32), emitted=jnp.full((slots, spec.chunk), -1, jnp.int32),
        evictions=zeros(), peak_slots=zeros(), held_after_round=zeros(), row_seeds=zeros(), rounds_run=jnp.int32(0),
        observations=spec.observations(slots, capacity),
        **({} if not spec.forced else dict(
            forced=jnp.full((slots, spec.forced), -1, jnp.int32),
            emitted_logprob=jnp.zeros((slots, spec.chunk), jnp.float32),
            emitted_greedy=jnp.zeros((slots, spec.chunk), bool))),
    )


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def insert(
    state: LoopState,
    prompt: Prefilled,
    row: Int[Array, ""],
    slot: Int[Array, ""],
    seed: Int[Array, ""],
    max_new: Int[Array, ""],
    stop_ids: Int[Array, " m"],
    forced: Int[Array, " f"] | None = None,
    *,
    spec: DecodeSpec,
) -> tuple[LoopState, Int[Array, ""]]:
    """Start a request in `slot` from row `row` of `prompt`: that row of the buffer and of the
    observations replaced, its counters reset, its first token sampled (key(seed), count 0), or
    `forced[0]` when it forces tokens (`forced` [spec.forced], -1 padded; needs spec.forced > 0).
    Returns the state (no other row touched) and the first token."""
    first = sample_tokens(prompt.logits[row][None], _row_keys(seed[None]), jnp.zeros((1,), jnp.int32),
                          spec.sampling)[0]
    teacher = {}
    if spec.forced:
        forced = jnp.full((spec.forced,), -1, jnp.int32) if forced is None else forced.astype(jnp.int32)
        first = jnp.where(forced[0] >= 0, forced[0], first)
        teacher = dict(forced=state.forced.at[slot].set(forced))
    elif forced is not None:
        raise ValueError("forced tokens need a DecodeSpec with forced > 0")
    active = ~jnp.any(first == stop_ids) & (max_new > 1)
    put = lambda x, value: x.at[slot].set(value)  # noqa: E731
    buffer = kv_buffer.insert_row(state.buffer, slot, prompt.buffer, row)
    length = prompt.buffer.prompt_lens[row]
    state = dataclasses.replace(
        state, buffer=buffer, last=put(state.last, first), active=put(state.active, active),
        n_new=put(state.n_new, 1), max_new=put(state.max_new, max_new), stop_ids=put(state.stop_ids, stop_ids),
        emitted=put(state.emitted, -1), evictions=put(state.evictions, 0), peak_slots=put(state.peak_slots, length),
        held_after_round=put(state.held_after_round, 0), row_seeds=put(state.row_seeds, seed),
        observations=obs_lib.insert_row(state.observations, slot, prompt.observations, row), **teacher,
    )
    return sharding.constrain(state, spec.config, spec.mesh), first


def _step(params, state: LoopState, index: Int[Array, ""], spec: DecodeSpec) -> LoopState:
    """Decode step number `index` of the chunk, for every active row."""
    buffer, active = state.buffer, state.active
    inputs = DecodeInputs(query_positions=buffer.prompt_lens + buffer.generated, n_filled=jnp.max(buffer.fill) + 1,
                          active=active)
    # the new slot's position in every layer, written once here rather than per layer: a
    # per-layer write, independent of the layer's input, made XLA copy `positions` every layer.
    # An inactive row's new slot stays empty (-1): it holds exactly what it held before.
    new_positions = jnp.where(active, inputs.query_positions, -1)
    buffer = dataclasses.replace(buffer, positions=buffer.positions.at[:, jnp.arange(active.shape[0]), :, buffer.fill]
                                 .set(new_positions[:, None, None], mode="drop"))
    attend = functools.partial(_decode_attend, half_as_bits=spec.platform == "cpu")
    decoder = Decoder(spec.config, spec.dtype, spec.dtype, attend=attend, unstacked=spec.unstacked)
    logits, cache = decoder.apply(
        {"params": params}, state.last[:, None], inputs.query_positions[:, None], inputs,
        CacheState(buffer, state.observations),
    )
    step = active.astype(jnp.int32)
    buffer = dataclasses.replace(cache.buffer, fill=buffer.fill + step, generated=buffer.generated + step)
    peak_slots = jnp.where(active, jnp.maximum(state.peak_slots, buffer.fill), state.peak_slots)
    token = sample_tokens(logits[:, 0], _row_keys(state.row_seeds), buffer.generated, spec.sampling)
    teacher = {}
    if spec.forced:  # the next token is forced[n_new] while the row has forced tokens left
        index_in = jnp.minimum(state.n_new, spec.forced - 1)[:, None]
        wanted = jnp.where(state.n_new < spec.forced, jnp.take_along_axis(state.forced, index_in, axis=1)[:, 0], -1)
        token = jnp.where(wanted >= 0, wanted, token)
        logprobs = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logprobs, token[:, None], axis=1)[:, 0]
        teacher = dict(
            emitted_logprob=state.emitted_logprob.at[:, index].set(jnp.where(active, chosen, 0.0)),
            emitted_greedy=state.emitted_greedy.at[:, index].set(active & (jnp.argmax(logprobs, axis=-1) == token)),
        )
    n_new = state.n_new + step
    stopped = jnp.any(token[:, None] == state.stop_ids, axis=-1) | (n_new >= state.max_new)
    state = dataclasses.replace(
        state, buffer=buffer, last=jnp.where(active, token, state.last), active=active & ~stopped, n_new=n_new,
        emitted=state.emitted.at[:, index].set(jnp.where(active, token, -1)), peak_slots=peak_slots,
        observations=cache.observations, **teacher,
    )
    return sharding.constrain(state, spec.config, spec.mesh)


def _round(state: LoopState, spec: DecodeSpec) -> LoopState:
    """The eviction round of every due row (inactive rows are frozen between rounds: never due)."""
    with jax.named_scope("eviction"):
        due = spec.policy.due(state.buffer)
        buffer, observations = jax.lax.cond(
            jnp.any(due), functools.partial(_evict, spec), lambda buf, obs, seeds: (buf, obs),
            state.buffer, state.observations, state.row_seeds,
        )
    state = dataclasses.replace(
        state, buffer=buffer, observations=observations, evictions=state.evictions + due,
        held_after_round=jnp.where(due, buffer.fill, state.held_after_round), rounds_run=state.rounds_run + jnp.any(due),
    )
    return sharding.constrain(state, spec.config, spec.mesh)


def _evict(spec: DecodeSpec, buffer: KVBuffer, observations, row_seeds):
    """One eviction round: the policy's keep-mask, then compaction of the buffer (and of what
    the policy observed per slot). With a mesh, each device runs it on the rows and KV heads it
    holds (`sharding.per_shard`): nothing moves between devices."""

    def local(buffer, observations, row_seeds):
        keep = spec.policy.keep_mask(buffer, row_seeds, observations, platform=spec.platform)
        buffer, order = compact(buffer, keep)
        return buffer, reorder(observations, order, buffer.valid)

    return sharding.per_shard(local, spec.config, spec.mesh, (buffer, observations, row_seeds), rows=(2,))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_chunk(params, state: LoopState, max_steps: Int[Array, ""], *, spec: DecodeSpec) -> LoopState:
    """Up to min(max_steps, spec.chunk) decode steps, fewer once no row is active. The tokens
    they produce are in `emitted` (reset at the start of the call)."""
    stop_at = jnp.minimum(max_steps, spec.chunk)

    def running(carry):
        s, index = carry
        return jnp.any(s.active) & (index < stop_at)

    def between_rounds(carry):  # at least one step, then steps until a row is due (or the chunk ends)
        s, index, first = carry
        return running((s, index)) & ((index == first) | ~jnp.any(spec.policy.due(s.buffer)))

    def step(carry):
        s, index, first = carry
        return _step(params, s, index, spec), index + 1, first

    def steps_then_round(carry):
        # The round sits outside the inner loop: a `lax.cond` inside it, returning the buffer
        # unchanged on most steps, made XLA copy the whole buffer every step.
        s, index, _ = jax.lax.while_loop(between_rounds, step, (*carry, carry[1]))
        return _round(s, spec), index

    state = sharding.constrain(dataclasses.replace(state, emitted=jnp.full_like(state.emitted, -1)),
                               spec.config, spec.mesh)
    state, _ = jax.lax.while_loop(running, steps_then_round, (state, jnp.int32(0)))
    return state
