"""What a policy is (`Policy`), and the skeleton every eviction policy shares (`EvictionPolicy`).

The decode loop talks to a policy through `Policy` only: how many slots a row needs, which rows
are due for a round, and a round's keep mask. `FullAttention` meets it by never being due.

Every eviction policy follows the shared rule of `randkv_jax.rule` (the paper's engine): a
round every `interval` generated tokens for a row holding more than `budget` T entries, keeping
the `window` newest entries, the `protect`ed prompt entries (inside the budget) and the best
scoring eligible entries, so that each (layer, row, KV head) then holds exactly T; ties go to
the older slot; kept entries stay in chronological order (`buffer.compact`). Subclasses only say
how to score eligible entries (`scores`) and what they need to observe while decoding (`needs`:
recent queries, accumulated attention; see `randkv_jax.observations`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from randkv_jax.buffer import KVBuffer
from randkv_jax.observations import Observations, ScoringNeeds
from randkv_jax.rule import EvictionRule, RoundMasks, select_top

PLATFORMS = ("cpu", "gpu", "tpu")
"""JAX platforms a decode program is built for (`DecodeSpec.platform`)."""

_OLD_CONVENTIONS = {
    "text": "budget=K meant K selected entries on top of the prompt and the window: use "
            "budget=K + window (or {cls}.from_selected(K, window=...)), the prompt now counts inside it",
    "engine": "budget=T was the engine's token_budget: that is what budget means now, drop convention=",
    "vllm": "budget counted prompt and window: budget now counts both; drop convention= and set "
            "window= and interval= (the plugin's WINDOW_SIZE=128, DIVIDE_LENGTH=64)",
}


class Policy(Protocol):
    """What the decode loop needs of a policy (all methods pure; the policy is a static jit argument)."""

    name: ClassVar[str]
    interval: int
    """Generated tokens between a row's rounds; requests start only at multiples of it, so the
    rows of a batch share their rounds (1 for a policy that never evicts)."""

    @property
    def needs(self) -> ScoringNeeds:
        """What the loop must record for the policy's scores."""
        ...

    def check_model(self, config) -> None:
        """Raise ValueError if the policy cannot run on a model with `config`."""
        ...

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots a row with this prompt length and generation cap can ever hold."""
        ...

    def due(self, buffer: KVBuffer) -> Bool[Array, " b"]:
        """Rows whose eviction round runs after the current step."""
        ...

    def keep_mask(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None, *, platform: str
    ) -> Bool[Array, "l b k s"]:
        """The entries each (layer, row, KV head) keeps this round (every valid one in rows not due).

        `platform` ("cpu", "gpu", "tpu") is where the program runs, resolved once before tracing."""
        ...


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Budget T, window w, interval i and prompt protection; see `randkv_jax.rule`.

    `interval` defaults to `window`; `buffer=r` is shorthand for window = interval = r (it
    overrides both). To state the budget as the selected part (the probes' "K = 1024 + W = 64"),
    use `from_selected(K, window=w)`, which sets T = K + w.
    """

    name: ClassVar[str] = "eviction"
    scores_across_heads: ClassVar[bool] = False
    """A slot's score mixes the heads of its layer (TOVA): the heads cannot be split over devices."""
    budget: int = 1024
    """T: entries each (layer, row, KV head) holds right after a round, window included."""
    window: int = 64
    """w: the newest entries, never evicted."""
    interval: int | None = None
    """i: generated tokens between rounds (None: equal to `window`)."""
    protect: str = "prompt"
    """"prompt", "sinks:N" or "none": prompt entries pinned inside the budget (see `rule`)."""
    buffer: dataclasses.InitVar[int | None] = None
    convention: dataclasses.InitVar[str | None] = None

    def __post_init__(self, buffer: int | None, convention: str | None):
        cls = type(self).__name__
        if convention is not None:
            hint = _OLD_CONVENTIONS.get(convention, "budget now always counts prompt and window")
            raise ValueError(f"{cls}: convention= is gone ({convention!r}): {hint.format(cls=cls)}")
        if buffer is not None:
            object.__setattr__(self, "window", buffer)
            object.__setattr__(self, "interval", buffer)
        elif self.interval is None:
            object.__setattr__(self, "interval", self.window)
        try:
            self.rule  # noqa: B018 (validates)
        except ValueError as e:
            raise ValueError(f"{cls}: {e}") from None
        self._validate()

    def _validate(self) -> None:
        """Subclasses check (and normalise) their own fields here."""

    @classmethod
    def from_selected(cls, selected: int, **kwargs):
        """The policy with budget T = `selected` + window (the probes' "K = 1024 + W = 64")."""
        window = next((kwargs[k] for k in ("buffer", "window") if kwargs.get(k) is not None), cls.window)
        return cls(budget=selected + window, **kwargs)

    @property
    def rule(self) -> EvictionRule:
        return EvictionRule(self.budget, self.window, self.interval, self.protect)

    @property
    def selected(self) -> int:
        """K_sel = T - w: entries a round keeps besides the window, pinned prompt entries included."""
        return self.rule.selected

    def check_model(self, config) -> None:
        """Raise ValueError if this policy cannot run on a model with `config` (default: it can)."""

    @property
    def needs(self) -> ScoringNeeds:
        """What the decode loop must record for `scores` (nothing, by default)."""
        return ScoringNeeds()

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.rule.capacity(prompt_len, max_new_tokens)

    def due(self, buffer: KVBuffer) -> Bool[Array, " b"]:
        return self.rule.due(buffer.fill, buffer.generated)

    def round_masks(self, buffer: KVBuffer) -> RoundMasks:
        """Pinned, window and eligible slots of every (layer, row, KV head)."""
        per_row = lambda x: x[None, :, None, None]  # noqa: E731
        return self.rule.masks(buffer.positions, per_row(buffer.prompt_lens), per_row(buffer.generated))

    def keep_mask(
        self,
        buffer: KVBuffer,
        row_seeds: Int[Array, " b"],
        observations: Observations | None = None,
        *,
        platform: str,
    ) -> Bool[Array, "l b k s"]:
        masks = self.round_masks(buffer)
        scores = self.scores(buffer, row_seeds, observations)
        count = self.rule.n_select(buffer.prompt_lens)[None, :, None]
        keep = masks.protected | select_top(scores, masks.eligible, count)
        return jnp.where(self.due(buffer)[None, :, None, None], keep, buffer.valid)

    def scores(
        self, buffer: KVBuffer, row_seeds: Int[Array, " b"], observations: Observations | None = None
    ) -> Float[Array, "l b k s"]:
        """A score per slot (higher is kept first); only eligible slots' scores matter."""
        raise NotImplementedError
