"""The eviction rule every policy shares: when a round runs, what it must keep, how many it picks.

One budget definition for every policy and every `protect` regime (the paper's engine,
`../shared/reference/algorithms.md` §1.2-1.3):

- `budget` T: the entries each (layer, row, KV head) holds right after a round, window included;
- `window` w: the newest w entries of the sequence, never evicted;
- `interval` i: generated tokens between rounds (the paper's grid has w = i = 64, its vLLM
  plugin w = 128, i = 64);
- `selected` K_sel = T - w: the entries a round keeps besides the window, *pinned ones included*;
- pinned: `protect="prompt"` pins positions 0 .. min(P, K_sel - 1) - 1, `"sinks:N"` the first
  min(N, P, K_sel - 1), `"none"` nothing. A prompt longer than K_sel - 1 has its tail compete
  with the generated entries, as in the engine (`pl = min(prompt_len, K_sel - 1)`);
- a row's round is due when its own generated count is a positive multiple of i and it holds
  more than T entries; the round keeps the window, the pinned entries and the
  K_sel - pinned best-scoring eligible entries (valid, neither pinned nor in the window), so every
  (layer, KV head) of the row then holds exactly T entries;
- capacity: a row never holds more than max(P, T) + i entries (nor more than P + max_new_tokens).

Why the window and the pins never overlap at a due round: it needs P + g > T = K_sel + w, so
the window starts at P + g - w > K_sel, past every pin (< K_sel - 1).

`masks` is the one function that says which entries are pinned, in the window and eligible: the
policies (XLA), `due` and the Pallas kernel's body (`kernels/random_keep.py`) all call it. It uses
only elementwise ops, so it runs inside a kernel on a [heads, slots] tile as well as on the whole
[l, b, k, s] buffer. `select_top` is the top-K step the scoring policies share.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

PROTECT_HELP = "'prompt', 'none' or 'sinks:N' with N > 0"


def parse_protect(protect: str) -> int | None:
    """"prompt" -> None (the whole prompt, up to K_sel - 1), "none" -> 0, "sinks:N" -> N."""
    if protect == "prompt":
        return None
    if protect == "none":
        return 0
    if protect.startswith("sinks:") and protect[6:].isdigit() and int(protect[6:]) > 0:
        return int(protect[6:])
    raise ValueError(f"protect must be {PROTECT_HELP}, got {protect!r}")


class RoundMasks(NamedTuple):
    """What a round does with each slot (all bool, the shape of `positions`)."""

    pinned: Bool[Array, "..."]
    """Valid prompt entries pinned by `protect` (inside K_sel)."""
    window: Bool[Array, "..."]
    """Valid entries among the w newest positions."""
    eligible: Bool[Array, "..."]
    """Valid entries a round may evict: neither pinned nor in the window."""

    @property
    def protected(self) -> Bool[Array, "..."]:
        """Entries a round never evicts."""
        return self.pinned | self.window

    @property
    def candidates(self) -> Bool[Array, "..."]:
        """Valid entries outside the window, pinned ones included: what the scoring policies'
        window attention normalises over (the engine's candidate list)."""
        return self.pinned | self.eligible


@dataclasses.dataclass(frozen=True)
class EvictionRule:
    """The budget T, window w, interval i and protection of a policy (hashable, static)."""

    budget: int
    window: int
    interval: int
    protect: str = "prompt"

    def __post_init__(self):
        for name in ("budget", "window", "interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.budget <= self.window:
            raise ValueError(
                f"budget T={self.budget} must exceed the window w={self.window}: T counts the window, "
                f"and a round selects T - w entries"
            )
        parse_protect(self.protect)

    @property
    def selected(self) -> int:
        """K_sel = T - w: entries a round keeps besides the window (pinned ones included)."""
        return self.budget - self.window

    def n_pinned(self, prompt_lens: Int[Array, "*b"]) -> Int[Array, "*b"]:
        """Pinned prompt entries per row: min(P, N, K_sel - 1) (N = P for "prompt", 0 for "none")."""
        sinks = parse_protect(self.protect)
        cap = self.selected - 1 if sinks is None else min(sinks, self.selected - 1)
        return jnp.minimum(prompt_lens, cap)

    def n_select(self, prompt_lens: Int[Array, "*b"]) -> Int[Array, "*b"]:
        """Eligible entries a due round keeps per (layer, row, KV head): K_sel - pinned."""
        return self.selected - self.n_pinned(prompt_lens)

    def masks(
        self, positions: Int[Array, "*s"], prompt_lens: Int[Array, "*s"], generated: Int[Array, "*s"]
    ) -> RoundMasks:
        """Pinned, window and eligible entries; `prompt_lens` and `generated` broadcast against
        `positions` (absolute position per slot, -1 = empty)."""
        valid = positions >= 0
        pinned = valid & (positions < self.n_pinned(prompt_lens))
        window = valid & (positions >= prompt_lens + generated - self.window)
        return RoundMasks(pinned, window, valid & ~(pinned | window))

    def due(self, fill: Int[Array, " b"], generated: Int[Array, " b"]) -> Bool[Array, " b"]:
        """Rows whose round runs now: generated a positive multiple of i, and more than T held.

        `fill` is the entries each (layer, KV head) of the row holds (all hold as many)."""
        return (generated > 0) & (generated % self.interval == 0) & (fill > self.budget)

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Most entries a row ever holds: min(P + max_new_tokens, max(P, T) + i)."""
        return min(prompt_len + max_new_tokens, max(prompt_len, self.budget) + self.interval)


def select_top(
    scores: Float[Array, "*h s"], eligible: Bool[Array, "*h s"], count: Int[Array, "*h"]
) -> Bool[Array, "*h s"]:
    """The `count` highest-scoring eligible slots along the last axis; ties -> lower slot.

    `count` broadcasts against the leading axes. Eligible slots rank before all others whatever
    their score (even -inf), so exactly min(count, #eligible) of them are kept.
    """
    order = jnp.lexsort((-scores.astype(jnp.float32), ~eligible), axis=-1)  # stable: ties by slot
    rank = jnp.argsort(order, axis=-1)  # rank of each slot in that order
    return eligible & (rank < jnp.asarray(count)[..., None])
