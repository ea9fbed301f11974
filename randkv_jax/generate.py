"""`generate`: batched generation with a bounded KV cache (Random Attention by default)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from randkv_jax.decode import DecodeSpec, LoopState, decode_chunk, padded_capacity, platform_of, prefill
from randkv_jax.models.model import Model
from randkv_jax.policies import RandomAttention
from randkv_jax.sampling import SamplingParams

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this, so lengths share compilations


@dataclasses.dataclass(frozen=True)
class RowStats:
    """What one request used. Byte counts are for keys and values of all layers and KV heads."""

    prompt_tokens: int
    new_tokens: int
    evictions: int  # eviction rounds run on the row
    held_after_round: int  # entries each layer and KV head held right after the last round (0: none ran)
    peak_slots: int  # most entries any layer and KV head held
    kv_bytes: int  # peak bytes held: peak_slots slots
    kv_bytes_full: int  # bytes a full cache holds for the same sequence (prompt + new tokens)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    texts: list[str] | None  # None when the model has no tokenizer
    tokens: list[list[int]]  # generated ids per row (prompt excluded, stop token included)
    stats: list[RowStats]
    decode_seconds: float  # wall time of the decode loop after its first chunk (prefill, compile excluded)
    decode_steps: int  # decode steps of the batch timed in decode_seconds
    state: LoopState | None = None  # the final loop state, when asked for (tests, probes)

    @property
    def decode_tokens_per_second(self) -> float:
        """Rows x timed steps / time: the batch's decode throughput (0 if nothing was timed)."""
        return len(self.tokens) * self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def encode_prompts(model: Model, prompts: Sequence[str | Sequence[int]], chat: bool, **template_kwargs) -> list[list[int]]:
    """Strings (through the chat template when `chat`) or token-id sequences -> id lists."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id sequences")
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            if chat:
                ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], **template_kwargs)
            else:
                ids = model.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a prompt encodes to zero tokens")
        if max(ids) >= model.config.vocab_size or min(ids) < 0:
            raise ValueError(f"token ids must lie in [0, {model.config.vocab_size})")
        encoded.append(list(ids))
    return encoded


def generate(
    model: Model,
    prompts: Sequence[str | Sequence[int]],
    *,
    policy: Any = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | Sequence[int] = 0,
    chat: bool = True,
    stop_tokens: Sequence[int] = (),
    ignore_eos: bool = False,
    capacity: int | None = None,
    chunk: int = 256,
    progress: Callable[[int, int], None] | None = None,
    return_state: bool = False,
    **template_kwargs: Any,
) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt under `policy` (default `RandomAttention()`).

    Args:
      prompts: strings (chat-formatted when `chat`, e.g. `enable_thinking=False` passes through
        to the template) or token-id sequences (works without a tokenizer).
      policy: a policy object from `randkv_jax.policies`, or a registered name.
      temperature, top_p, top_k: sampling (temperature 0 = greedy).
      seed: one int (row i uses seed + i) or one seed per prompt; a row's sampling and eviction
        randomness depend only on its seed, not on the batch.
      stop_tokens: extra stop ids besides the tokenizer's and config's EOS ids.
      ignore_eos: do not stop at EOS (fixed-length runs: benchmarks, probes); `stop_tokens` still stop.
      capacity: the buffer's slot count (e.g. to share one compilation between calls); refused
        if the prompts and policy need more. Default: what they need, rounded up to attention blocks.
      chunk: decode steps per device call (between progress reports).
      progress: called as progress(steps, max_new_tokens) after each chunk, `steps` being the
        batch's decode steps so far (+1 for the prefill's token): its progress towards the cap.
    """
    from randkv_jax import policies

    policy = RandomAttention() if policy is None else policy
    if isinstance(policy, str):
        policy = policies.get(policy)
    policy.check_model(model.config)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = encode_prompts(model, prompts, chat, **template_kwargs)
    b = len(ids)
    seeds = [seed + i for i in range(b)] if isinstance(seed, int) else [int(s) for s in seed]
    if len(seeds) != b:
        raise ValueError(f"got {len(seeds)} seeds for {b} prompts")

    longest = max(len(p) for p in ids)
    padded_len = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
    # prefill writes the padded prompt; no row holds more than the policy's capacity for it
    needed = max(padded_len, policy.capacity(longest, max_new_tokens))
    if capacity is None:  # (>= padded_len: blocks of 128 are whole multiples of the 64-token bucket)
        capacity = padded_capacity(policy, longest, max_new_tokens)
    elif capacity < needed:
        raise ValueError(
            f"capacity {capacity} is too small: the longest prompt ({longest} tokens, padded to {padded_len}) "
            f"with {policy} and max_new_tokens={max_new_tokens} needs {needed} slots"
        )
    prompt_array = np.zeros((b, padded_len), np.int32)
    for row, p in enumerate(ids):
        prompt_array[row, : len(p)] = p

    spec = DecodeSpec(
        config=model.config, dtype=model.dtype, policy=policy,
        sampling=SamplingParams(temperature, top_p, top_k), max_new_tokens=max_new_tokens,
        stop_ids=_stop_ids(model, stop_tokens, ignore_eos), pad_id=_pad_id(model), platform=platform_of(model.params),
    )
    lens = jnp.asarray([len(p) for p in ids], jnp.int32)
    state = prefill(model.params, jnp.asarray(prompt_array), lens, jnp.asarray(seeds, jnp.int32),
                    spec=spec, capacity=capacity)
    start, start_step = None, 0
    while not bool(jnp.all(state.done)):
        state = decode_chunk(model.params, state, jnp.int32(chunk), spec=spec)
        step = int(jnp.max(state.buffer.generated))  # waits for the chunk
        if start is None:  # time from the end of the first chunk: compilation is not decoding
            start, start_step = time.perf_counter(), step
        if progress is not None:
            progress(step + 1, max_new_tokens)
    seconds = 0.0 if start is None else time.perf_counter() - start
    steps = int(jnp.max(state.buffer.generated)) - start_step
    return _result(model, ids, state, seconds, steps, return_state)


def _stop_ids(model: Model, extra: Sequence[int], ignore_eos: bool) -> tuple[int, ...]:
    ids = {int(t) for t in extra}
    if not ignore_eos:
        ids |= set(model.config.eos_token_ids)
        if model.tokenizer is not None:
            ids |= set(model.tokenizer.eos_token_ids)
    return tuple(sorted(ids))


def _pad_id(model: Model) -> int:
    c = model.config
    if c.pad_token_id is not None:
        return int(c.pad_token_id)
    return int(c.eos_token_ids[0]) if c.eos_token_ids else 0


def _result(model: Model, ids, state: LoopState, seconds: float, steps: int, return_state: bool) -> GenerationResult:
    n_new = np.asarray(state.n_new)
    tokens = [row[:n].tolist() for row, n in zip(np.asarray(state.tokens), n_new)]
    per_slot = state.buffer.bytes_per_slot()
    stats = [
        RowStats(
            prompt_tokens=len(p), new_tokens=int(n), evictions=int(e), held_after_round=int(h), peak_slots=int(s),
            kv_bytes=int(s) * per_slot, kv_bytes_full=(len(p) + int(n)) * per_slot,
        )
        for p, n, e, h, s in zip(ids, n_new, np.asarray(state.evictions), np.asarray(state.held_after_round),
                                 np.asarray(state.peak_slots))
    ]
    texts = None if model.tokenizer is None else model.tokenizer.batch_decode(tokens)
    return GenerationResult(texts, tokens, stats, seconds, steps, state if return_state else None)
