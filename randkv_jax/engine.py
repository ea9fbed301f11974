"""`Engine`: continuous batching over a fixed number of batch slots, eviction inside the jitted loop.

    engine = Engine(model, policy=RandomAttention(budget=1024), slots=8, max_prompt_tokens=1024,
                    max_new_tokens=32768, temperature=0.6, top_p=0.95)
    ids = engine.submit("What is 17 * 23?", n=16, seed=0)   # 16 samples share one prefill
    for done in engine.run():                               # completions as they finish
        print(done.request_id, done.text, done.stats)

Requests (a prompt, max_new_tokens, a seed, stop tokens) wait in a queue. Between decode chunks
the engine fills free slots: it prefills the request's prompt (right-padded to a multiple of 64
tokens, one prompt per call, so a request's numerics never depend on its neighbours), and
`decode.insert`s it into the slot (a jitted, donated update of that row only). Every row carries
its own generated count: the sampling key, the eviction rounds and their random draws follow it,
so a request's tokens are those it produces alone in the same engine shape, whatever slot it lands
in and whatever runs beside it.

Refills happen only at chunk boundaries that are multiples of the policy's interval (chunks are
rounded up to one), so every active row's count stays a multiple of the interval at those
boundaries and all rows' rounds fall on the same steps: one batched round per interval, as in
static batching (`LoopState.rounds_run` counts them). The cost is that a finished row's slot
waits for the end of the chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from randkv_jax import decode, sharding
from randkv_jax.decode import (
    MAX_STOP_IDS,
    DecodeSpec,
    Prefilled,
    padded_capacity,
    platform_of,
)
from randkv_jax.models.decoder import unstack_layers
from randkv_jax.models.model import Model
from randkv_jax.sampling import SamplingParams

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this, so lengths share compilations
DEFAULT_CHUNK = 64  # decode steps per device call (rounded up to a multiple of the policy's interval)


@dataclasses.dataclass(frozen=True)
class RowStats:
    """What one request used. Byte counts are for keys and values of all layers and KV heads."""

    prompt_tokens: int
    new_tokens: int  # generated tokens, the stop token included
    evictions: int  # eviction rounds run on the request
    held_after_round: int  # entries each layer and KV head held right after the last round (0: none ran)
    peak_slots: int  # most entries any layer and KV head held
    kv_bytes: int  # peak bytes held: peak_slots slots
    kv_bytes_full: int  # bytes a full cache holds for the same sequence (prompt + new tokens)
    finish_reason: str = "length"  # "stop" (a stop token), "length" (max_new_tokens) or "cancelled"
    queue_seconds: float = 0.0  # from submit to the start of its prefill
    first_token_seconds: float = 0.0  # from submit to its first token


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished (or cancelled) request."""

    request_id: int
    tokens: list[int]  # generated ids (prompt excluded, stop token included)
    text: str | None  # None when the model has no tokenizer
    stats: RowStats
    slot: int | None  # the batch slot it ran in (None: cancelled before it started)
    logprobs: list[float] | None = None  # teacher-forcing engines: log p of tokens[1:] (float32)
    greedy: list[bool] | None = None  # teacher-forcing engines: tokens[1:] were each the model's argmax


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a run stands, after each decode chunk."""

    completed: int
    running: int
    queued: int
    tokens: int  # tokens generated so far (all requests)
    steps: int  # decode steps run
    elapsed_seconds: float  # since the run started
    decode_seconds: float  # of which in decode chunks

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Remaining time at the pace so far (None before the first request completes)."""
        if not self.completed:
            return None
        return self.elapsed_seconds / self.completed * (self.running + self.queued)


@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    pending: int  # samples not yet inserted
    prefilled: Prefilled | None = None


@dataclasses.dataclass
class _Request:
    id: int
    prompt: _Prompt
    max_new: int
    seed: int
    stop_ids: np.ndarray  # [MAX_STOP_IDS] int32, -1 padded
    submitted: float
    started: float = 0.0
    first_token_at: float = 0.0
    first: Any = None  # the first token (a device scalar until read)
    tokens: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    forced: np.ndarray | None = None  # [forced] int32, -1 padded (teacher-forcing engines)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    greedy: list[bool] = dataclasses.field(default_factory=list)


def encode_prompt(model: Model, prompt: str | Sequence[int], chat: bool, **template_kwargs) -> list[int]:
    """A string (through the chat template when `chat`) or a token-id sequence -> an id list."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        if chat:
            ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], **template_kwargs)
        else:
            ids = model.tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) or isinstance(prompt, np.ndarray):
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"a prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("a prompt encodes to zero tokens")
    if max(ids) >= model.config.vocab_size or min(ids) < 0:
        raise ValueError(f"token ids must lie in [0, {model.config.vocab_size})")
    return list(ids)


def bucket(length: int) -> int:
    """The padded prompt length a prompt of `length` tokens is prefilled at."""
    return -(-length // PROMPT_BUCKET) * PROMPT_BUCKET


class Engine:
    """A request queue over `slots` fixed batch rows of `capacity` KV slots each (see the module docstring).

    Args:
      policy: a policy object or a registered name (default `RandomAttention()`).
      slots: batch rows decoded together.
      capacity: KV slots per row; default: what a `max_prompt_tokens` prompt generating
        `max_new_tokens` needs under `policy`, rounded up to attention blocks.
      temperature, top_p, top_k: sampling, the same for every request (temperature 0 = greedy).
      chunk: decode steps per device call (default 64), rounded up to a multiple of the policy's
        interval.
      forced_tokens: the most tokens a request may force (`submit(forced=...)`; 0: none). Such an
        engine also reports each produced token's log-probability and whether it was the argmax.
      mesh: run on several devices (`randkv_jax.sharding.parse_mesh("data=D,model=M")`): slots
        split over `data` (a multiple of it), KV heads and parameters over `model`. The model's
        parameters are placed on the mesh if they are not already.
    """

    def __init__(
        self,
        model: Model,
        *,
        policy: Any = None,
        slots: int = 8,
        capacity: int | None = None,
        max_prompt_tokens: int = 1024,
        max_new_tokens: int = 2048,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        chunk: int = DEFAULT_CHUNK,
        forced_tokens: int = 0,
        mesh: Mesh | None = None,
    ):
        from randkv_jax import policies

        policy = policies.RandomAttention() if policy is None else policy
        if isinstance(policy, str):
            policy = policies.get(policy)
        policy.check_model(model.config)
        for name, value in (("slots", slots), ("max_prompt_tokens", max_prompt_tokens),
                            ("max_new_tokens", max_new_tokens), ("chunk", chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if capacity is None:
            capacity = padded_capacity(policy, bucket(max_prompt_tokens), max_new_tokens)
        elif not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        if mesh is not None:
            sharding.check_mesh(mesh)
            sharding.check_rows(slots, mesh)
            model = dataclasses.replace(model, params=sharding.shard_params(model.params, model.config, mesh))
        self.mesh = mesh
        self.model, self.policy, self.slots, self.capacity = model, policy, slots, capacity
        self.max_new_tokens = max_new_tokens
        self.interval = policy.interval
        self.spec = DecodeSpec(
            config=model.config, dtype=model.dtype, policy=policy, sampling=SamplingParams(temperature, top_p, top_k),
            chunk=-(-chunk // self.interval) * self.interval, platform=platform_of(model.params),
            forced=forced_tokens, mesh=mesh, unstacked=mesh is None and platform_of(model.params) == "cpu",
        )
        # the decode program's parameters: on CPU a per-layer copy (`DecodeSpec.unstacked`)
        self._decode_params = unstack_layers(model.params) if self.spec.unstacked else model.params
        self._eos = set(model.config.eos_token_ids) | (set(model.tokenizer.eos_token_ids) if model.tokenizer else set())
        self._queue: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # slot -> request
        self._finished: list[Completion] = []  # cancelled while queued, not yet returned
        self._next_id = 0
        self.steps = 0  # decode steps run
        self.decode_seconds = 0.0  # wall time in decode chunks (compilation excluded)
        self.decode_tokens = 0  # tokens produced by decode steps
        self.prefills = 0  # prompts prefilled
        self._steps_since_idle = 0
        start = time.perf_counter()
        # compile the decode program now (a call of zero steps), so no chunk's time includes it
        state = decode.empty_state(self.spec, slots, capacity)
        if mesh is not None:
            state = jax.device_put(state, sharding.state_shardings(state, model.config, mesh))
        self.state = decode.decode_chunk(self._decode_params, state, jnp.int32(0), spec=self.spec)
        jax.block_until_ready(self.state)
        self.compile_seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int | None = None,
        seed: int | Sequence[int] = 0,
        n: int = 1,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        chat: bool = True,
        forced: Sequence[int] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Queue `n` samples of one prompt (they share one prefill); returns their request ids.

        seed: one int (sample j uses seed + j) or one seed per sample. stop_tokens: extra stop ids
        besides the model's EOS ids (which `ignore_eos` drops). forced: token ids the request
        generates first, fed instead of sampled (teacher forcing; an engine built with
        `forced_tokens` >= their count). A request that cannot run here
        (empty prompt, bad ids, too long for the slots' capacity, ...) raises ValueError and
        leaves the engine as it was.
        """
        ids = encode_prompt(self.model, prompt, chat, **template_kwargs)
        max_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        seeds = [seed + j for j in range(n)] if isinstance(seed, int) else [int(s) for s in seed]
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} samples")
        need = max(bucket(len(ids)), self.policy.capacity(len(ids), max_new))
        if need > self.capacity:
            raise ValueError(
                f"request {self._next_id} does not fit: its prompt ({len(ids)} tokens, prefilled at {bucket(len(ids))}) "
                f"with max_new_tokens={max_new} needs {need} KV slots under {self.policy}; this engine's slots hold "
                f"{self.capacity} (raise capacity= or max_prompt_tokens=)"
            )
        stops = sorted({int(t) for t in stop_tokens} | (set() if ignore_eos else self._eos))
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop tokens per request (EOS included), got {len(stops)}")
        stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop_ids[: len(stops)] = stops
        forced_ids = None
        if forced is not None:
            forced = [int(t) for t in forced]
            if len(forced) > self.spec.forced:
                raise ValueError(f"{len(forced)} forced tokens, this engine takes at most {self.spec.forced} "
                                 "(Engine(forced_tokens=...))")
            if forced and not 0 <= min(forced) <= max(forced) < self.model.config.vocab_size:
                raise ValueError(f"forced token ids must lie in [0, {self.model.config.vocab_size})")
            forced_ids = np.full((self.spec.forced,), -1, np.int32)
            forced_ids[: len(forced)] = forced
        shared = _Prompt(ids, pending=n)
        now = time.perf_counter()
        out = []
        for s in seeds:
            self._queue.append(_Request(self._next_id, shared, max_new, s, stop_ids, now, forced=forced_ids))
            out.append(self._next_id)
            self._next_id += 1
        return out

    def cancel(self, request_id: int) -> bool:
        """Stop a queued or running request; its completion (finish_reason "cancelled", the tokens
        so far) comes out of the next `step`. False if it is unknown or already finished."""
        for request in self._queue:
            if request.id == request_id:
                self._queue.remove(request)
                self._inserted(request.prompt)
                self._finished.append(self._completion(request, None, "cancelled"))
                return True
        for slot, request in self._running.items():
            if request.id == request_id:
                self.state = dataclasses.replace(self.state, active=self.state.active.at[slot].set(False))
                request.cancelled = True
                return True
        return False

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def running_slots(self) -> list[int]:
        """The slots holding a running request."""
        return sorted(self._running)

    # ------------------------------------------------------------------ the loop

    def run(self, progress: Callable[[Progress], None] | None = None) -> Iterator[Completion]:
        """Step until every submitted request has completed, yielding completions as they finish."""
        start, decode_at_start = time.perf_counter(), self.decode_seconds
        completed = tokens = 0
        while self._queue or self._running or self._finished:
            for done in self.step():
                completed += 1
                tokens += len(done.tokens)
                yield done
            if progress is not None:
                live = sum(len(r.tokens) + 1 for r in self._running.values())
                progress(Progress(completed, self.running, self.queued, tokens + live, self.steps,
                                  time.perf_counter() - start, self.decode_seconds - decode_at_start))

    def step(self) -> list[Completion]:
        """Fill free slots (at an interval boundary), run one decode chunk, return what finished."""
        finished, self._finished = self._finished, []
        if not self._running:
            self._steps_since_idle = 0
        if self._steps_since_idle % self.interval == 0:
            self._refill()
        if not self._running:
            return finished
        start = time.perf_counter()
        self.state = decode.decode_chunk(self._decode_params, self.state, jnp.int32(self.spec.chunk), spec=self.spec)
        emitted, active, n_new, logprobs, greedy = jax.device_get((
            self.state.emitted, self.state.active, self.state.n_new, self.state.emitted_logprob,
            self.state.emitted_greedy))
        self.decode_seconds += time.perf_counter() - start
        steps = int((emitted >= 0).any(axis=0).sum())
        self.steps += steps
        self._steps_since_idle += steps
        for slot, request in list(self._running.items()):
            if request.first is not None:
                request.tokens.append(int(request.first))
                request.first = None
            produced = emitted[slot] >= 0
            new = emitted[slot][produced].tolist()
            request.tokens.extend(new)
            if logprobs is not None:
                request.logprobs.extend(logprobs[slot][produced].tolist())
                request.greedy.extend(greedy[slot][produced].tolist())
            self.decode_tokens += len(new)
            assert len(request.tokens) == int(n_new[slot])
            if not active[slot]:
                finished.append(self._release(slot))
        return finished

    def _refill(self) -> None:
        free = [slot for slot in range(self.slots) if slot not in self._running]
        for slot in free:
            if not self._queue:
                break
            request = self._queue.popleft()
            request.started = time.perf_counter()
            shared = request.prompt
            if shared.prefilled is None:
                tokens = np.zeros((1, bucket(len(shared.ids))), np.int32)
                tokens[0, : len(shared.ids)] = shared.ids
                shared.prefilled = decode.prefill(self.model.params, jnp.asarray(tokens),
                                                  jnp.asarray([len(shared.ids)], jnp.int32), spec=self.spec)
                self.prefills += 1
            self.state, request.first = decode.insert(
                self.state, shared.prefilled, jnp.int32(0), jnp.int32(slot), jnp.int32(request.seed),
                jnp.int32(request.max_new), jnp.asarray(request.stop_ids),
                None if request.forced is None else jnp.asarray(request.forced), spec=self.spec,
            )
            request.first = request.first.block_until_ready()
            request.first_token_at = time.perf_counter()
            self._inserted(shared)
            self._running[slot] = request

    @staticmethod
    def _inserted(prompt: _Prompt) -> None:
        """One sample of `prompt` is in a slot (or cancelled): free its prefill after the last."""
        prompt.pending -= 1
        if not prompt.pending:
            prompt.prefilled = None

    def _release(self, slot: int) -> Completion:
        """The completion of the request in `slot`, which becomes free."""
        request = self._running.pop(slot)
        if request.cancelled:
            reason = "cancelled"
        else:
            reason = "stop" if int(request.stop_ids[0]) >= 0 and request.tokens[-1] in request.stop_ids else "length"
        return self._completion(request, slot, reason)

    def _completion(self, request: _Request, slot: int | None, reason: str) -> Completion:
        per_slot = self.state.buffer.bytes_per_slot()
        p = len(request.prompt.ids)
        if slot is None:  # never ran
            evictions = held = 0
            peak = 0
        else:
            row = jax.device_get((self.state.evictions[slot], self.state.held_after_round[slot],
                                  self.state.peak_slots[slot]))
            evictions, held, peak = (int(x) for x in row)
        stats = RowStats(
            prompt_tokens=p, new_tokens=len(request.tokens), evictions=evictions, held_after_round=held,
            peak_slots=peak, kv_bytes=peak * per_slot, kv_bytes_full=(p + len(request.tokens)) * per_slot,
            finish_reason=reason,
            queue_seconds=(request.started - request.submitted) if request.started else 0.0,
            first_token_seconds=(request.first_token_at - request.submitted) if request.first_token_at else 0.0,
        )
        text = None if self.model.tokenizer is None else self.model.tokenizer.decode(request.tokens)
        teacher = {} if not self.spec.forced else dict(logprobs=list(request.logprobs), greedy=list(request.greedy))
        return Completion(request.id, list(request.tokens), text, stats, slot, **teacher)
