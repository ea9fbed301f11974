"""FullAttention: no eviction; the buffer holds the prompt and every generated token."""

from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class FullAttention:
    name: ClassVar[str] = "full"

    def capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens
