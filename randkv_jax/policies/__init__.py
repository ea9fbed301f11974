"""Eviction policies, by class or by name: `get("random", budget=512)`, `available()`."""

from __future__ import annotations

from randkv_jax.policies.base import EvictionPolicy
from randkv_jax.policies.full import FullAttention
from randkv_jax.policies.random import RandomAttention

_REGISTRY = {cls.name: cls for cls in (FullAttention, RandomAttention)}


def available() -> list[str]:
    """Names accepted by `get`."""
    return sorted(_REGISTRY)


def get(name: str, **kwargs):
    """Build the policy registered as `name` with the given fields."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name](**kwargs)


__all__ = ["EvictionPolicy", "FullAttention", "RandomAttention", "available", "get"]
