"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
keep the first 4 tokens (attention sinks) and the most recent ones.

Here: `Recency`'s position score with protect="sinks:4" by default, so a round keeps positions
0..3, the K newest eligible entries and the r-token window (K + r recent tokens in all). The
R-KV repo's and kvpress' `StreamingLLMPress` (n_sink=4) keep the first 4 plus the newest
budget - 4; set `protect` to "prompt" or "none" for the paper's controlled comparison. Sinks are
prompt tokens ("sinks:N" protects the first min(N, prompt length)), so a prompt shorter than 4
tokens has fewer sinks (the original counts the first 4 tokens of the sequence).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from randkv_jax.policies.recency import Recency


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Recency):
    name: ClassVar[str] = "streaming"
    protect: str = "sinks:4"
