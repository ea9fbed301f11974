"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
keep the first 4 tokens (attention sinks) and the most recent ones.

Here: `Recency`'s position score with protect="sinks:4" by default, so a round keeps positions
0..3 and the newest budget - 4 entries (the window among them), as the R-KV repo's and kvpress'
`StreamingLLMPress` (n_sink=4) do; set `protect` to "prompt" or "none" for the paper's
controlled comparison. Sinks are prompt tokens ("sinks:N" pins the first min(N, P, K_sel - 1)),
so a prompt shorter than 4 tokens has fewer sinks (the original counts the first 4 tokens of
the sequence).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from randkv_jax.policies.recency import Recency


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Recency):
    name: ClassVar[str] = "streaming"
    protect: str = "sinks:4"
