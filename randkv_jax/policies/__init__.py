"""Eviction policies, by class or by name: `get("random", budget=512)`, `available()`.

Every policy meets `base.Policy`; all but `FullAttention` share Random Attention's skeleton
(`base.EvictionPolicy` on `randkv_jax.rule`): one budget T held after each round (window and
pinned prompt included), the window w, the interval i, the `protect` option and chronological
compaction; they differ only in how they score eligible entries.
"""

from __future__ import annotations

import dataclasses

from randkv_jax.policies.base import EvictionPolicy, Policy
from randkv_jax.policies.full import FullAttention
from randkv_jax.policies.h2o import H2O
from randkv_jax.policies.random import RandomAttention
from randkv_jax.policies.recency import Recency
from randkv_jax.policies.rkv import RKV
from randkv_jax.policies.snapkv import SnapKV
from randkv_jax.policies.streaming import StreamingLLM
from randkv_jax.policies.tova import TOVA
from randkv_jax.policies.triattention import TriAttention
from randkv_jax.policies.vase import VaSE

_REGISTRY = {
    cls.name: cls
    for cls in (FullAttention, RandomAttention, SnapKV, RKV, VaSE, TriAttention, H2O, StreamingLLM, TOVA, Recency)
}


def available() -> list[str]:
    """Names accepted by `get`."""
    return sorted(_REGISTRY)


def _lookup(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name]


def get(name: str, **kwargs):
    """Build the policy registered as `name` with the given fields."""
    return _lookup(name)(**kwargs)


def fields_of(name: str) -> set[str]:
    """The constructor fields of the policy registered as `name`."""
    return {f.name for f in dataclasses.fields(_lookup(name))}


__all__ = [
    "EvictionPolicy", "FullAttention", "Policy", "H2O", "RKV", "RandomAttention", "Recency", "SnapKV", "StreamingLLM",
    "TOVA", "TriAttention", "VaSE", "available", "fields_of", "get",
]
