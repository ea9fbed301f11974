"""The transformers side of `randkv bench`: the same weights, decoded by transformers `generate`.

- `to_transformers(model)`: a float32 CPU `LlamaForCausalLM` / `Qwen3ForCausalLM` /
  `Phi3ForCausalLM` (sdpa attention, eval mode) holding `model`'s parameters. The config is the
  inverse of `config_from_hf_dict` (checked by reading it back); the weights are the inverse of
  `randkv_jax.models.hf.key_table`, driven by the same table: each rule's targets are read back
  from our leaves, un-transposed to torch's `[out, in]`, and concatenated by rows (Phi-3's fused
  `qkv_proj` and `gate_up_proj`). A parameter of ours that no rule reads, or a transformers
  parameter that no rule writes, is a `ValueError` naming it.
- `hf_generate(hf_model, prompts, max_new_tokens, cache=...)`: greedy, EOS ignored, one batch of
  equal-length prompts (no padding), timed, with the time each token arrived (a streamer's
  timestamps, so the prefill is told apart from the decode steps exactly).
- `hf_decode_tokens_per_second(...)`: decode throughput without the prefill, from those timestamps.
- `set_threads(n)`: torch's intra-op thread count, to match JAX's.

Importing this module imports torch and transformers: only benchmarks and tests do.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any

import jax
import numpy as np
import torch
import transformers
from transformers.generation.streamers import BaseStreamer
from randkv_jax.models.config import ModelConfig, config_from_hf_dict
from randkv_jax.models.hf import key_table
from randkv_jax.models.model import Model

# architecture -> transformers model_type (the config and model classes are named after it).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}
# RopeConfig fields written into rope_parameters under their own names when set (None = unset).
ROPE_FIELDS = ("factor", "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor",
               "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow")
CACHES = ("dynamic", "static")


def set_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads to `n` (default `os.cpu_count()`); returns the count set."""
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


# -- config ----------------------------------------------------------------------------------


def hf_config_dict(c: ModelConfig) -> dict[str, Any]:
    """The transformers 5.x `config.json` fields describing `c` (inverse of `config_from_hf_dict`)."""
    if c.architecture not in MODEL_TYPES:
        raise ValueError(f"no transformers model for architecture {c.architecture!r}")
    phi3 = c.architecture == "Phi3ForCausalLM"
    r = c.rope
    if r.partial_rotary_factor != 1.0 and r.rope_type == "default" and not phi3:
        # transformers' Llama/Qwen3 default RoPE rotates the whole head, whatever the factor says.
        raise ValueError(
            f"{c.architecture} with partial_rotary_factor={r.partial_rotary_factor} and default RoPE: "
            "transformers would rotate every head dim, so it is no baseline for this config"
        )
    rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.partial_rotary_factor != 1.0 or phi3:
        rope["partial_rotary_factor"] = r.partial_rotary_factor
    scaled = r.rope_type in ("llama3", "yarn", "longrope")  # the types that read the original length
    for field in ROPE_FIELDS:
        value = getattr(r, field)
        if value is not None and (scaled or field != "original_max_position_embeddings"):
            rope[field] = list(value) if isinstance(value, tuple) else value
    if r.rope_type == "yarn":
        rope["truncate"] = r.truncate
    eos = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else (c.eos_token_ids[0] if c.eos_token_ids else None)
    d: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": MODEL_TYPES[c.architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": rope,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": c.pad_token_id,
        "dtype": "float32",
    }
    if r.original_max_position_embeddings is not None:
        # Top-level too: Phi-3 keeps it there (transformers prefers that copy over rope_parameters'),
        # and our reader falls back to it, so an unscaled RoPE's value still reads back.
        d["original_max_position_embeddings"] = r.original_max_position_embeddings
    if phi3:
        d["sliding_window"] = None
    else:
        d["attention_bias"] = False
        d["mlp_bias"] = False
        d["use_sliding_window"] = False
    return d


def hf_config(c: ModelConfig) -> transformers.PretrainedConfig:
    """The transformers config for `c`, checked to read back (`config_from_hf_dict`) as `c`."""
    d = hf_config_dict(c)
    config = transformers.AutoConfig.for_model(**d)
    back = dataclasses.replace(config_from_hf_dict(config.to_dict(), source="transformers config"),
                               checkpoint_dtype=c.checkpoint_dtype)
    if back != c:
        diff = {f.name: (getattr(c, f.name), getattr(back, f.name))
                for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(back, f.name)}
        raise ValueError(f"transformers reads the config back differently (ours, theirs): {diff}")
    return config


# -- weights ---------------------------------------------------------------------------------


def hf_state_dict(model: Model) -> dict[str, np.ndarray]:
    """Our parameters as transformers tensors ({HF name: float32 [out, in] array}).

    The inverse of `key_table`: for every rule (and layer), each target's leaf is reshaped to its
    rows of the HF tensor (`[in, rows]`, transposed back, for Linear weights) and the rows are
    concatenated. Raises a ValueError naming any parameter that is missing, misshapen or unread.
    """
    c = model.config
    flat = {"/".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(model.params)}
    host: dict[str, np.ndarray] = {}  # each leaf copied to the host once, as float32
    unread = set(flat)
    tensors: dict[str, np.ndarray] = {}
    for rule in key_table(c):
        for layer in range(c.num_layers) if rule.per_layer else [None]:
            key = rule.hf_key.format(i=layer)
            parts = []
            for target in rule.targets:
                name = "/".join(target.path)
                if name not in flat:
                    raise ValueError(f"parameter {name} is missing: transformers' {key} needs it")
                unread.discard(name)
                if name not in host:
                    host[name] = np.asarray(flat[name]).astype(np.float32, copy=False)
                leaf = host[name]
                if layer is not None and (leaf.ndim == 0 or leaf.shape[0] != c.num_layers):
                    raise ValueError(f"parameter {name} has shape {leaf.shape}: expected {c.num_layers} layers first")
                x = leaf if layer is None else leaf[layer]
                rows = rule.hf_shape[0] if target.rows is None else target.rows[1] - target.rows[0]
                shape = (rows, *rule.hf_shape[1:])
                if x.size != math.prod(shape):
                    raise ValueError(f"parameter {name} has shape {leaf.shape}: cannot fill {shape} of {key}")
                parts.append(x.reshape(shape[::-1]).T if target.transpose else x.reshape(shape))
            tensors[key] = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], order="C")  # a writable copy
    if unread:
        raise ValueError(f"parameter(s) {', '.join(sorted(unread))} not consumed: no transformers tensor of "
                         f"{c.architecture} is built from them")
    return tensors


def to_transformers(model: Model) -> transformers.PreTrainedModel:
    """A float32 CPU transformers model (sdpa attention, eval mode) with `model`'s weights."""
    config = hf_config(model.config)
    tensors = hf_state_dict(model)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    hf_params = dict(hf.named_parameters())  # tied weights appear once, under the embedding's name
    unset = sorted(hf_params.keys() - tensors.keys())
    if unset:
        raise ValueError(f"transformers parameter(s) {', '.join(unset)} left unset: no parameter of ours maps to them")
    unexpected = sorted(tensors.keys() - hf_params.keys())
    if unexpected:
        raise ValueError(f"tensor(s) {', '.join(unexpected)} have no parameter in transformers' {type(hf).__name__}")
    with torch.no_grad():
        for name, p in hf_params.items():
            value = torch.from_numpy(tensors.pop(name))
            if value.shape != p.shape:
                raise ValueError(f"transformers parameter {name} has shape {tuple(p.shape)}, ours {tuple(value.shape)}")
            p.copy_(value)
    if model.config.tie_word_embeddings and hf.get_output_embeddings().weight is not hf.get_input_embeddings().weight:
        raise ValueError("tie_word_embeddings is set but transformers' lm_head is not tied to embed_tokens")
    return hf.eval()


# -- generation ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFRun:
    """One `generate` call: generated ids per row (prompt excluded), its wall time, and when each
    generated token arrived (`token_times[k]`: token k + 1 of every row; `token_times[0]` ends the
    prefill, which produces the first token; `time.perf_counter` seconds)."""

    tokens: list[list[int]]
    seconds: float
    token_times: tuple[float, ...]

    @property
    def decode_seconds(self) -> float:
        """The decode steps' time: from the first token (the prefill's) to the last."""
        return self.token_times[-1] - self.token_times[0]


class _TokenClock(BaseStreamer):
    """A `generate` streamer that records when each `put` arrives (the first one is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_generate(hf_model: transformers.PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, *,
                cache: str, cache_len: int | None = None) -> HFRun:
    """Greedy `generate` of exactly `max_new_tokens` per prompt, EOS ignored, timed per token.

    `prompts` must all have the same length: they are one [batch, time] tensor, no padding.
    `cache`: "dynamic" (DynamicCache) or "static" (StaticCache, not compiled). `cache_len` (static
    only): the StaticCache's slots, default prompt + `max_new_tokens`; transformers' sdpa attends
    over all of them every step, so a step costs the same at any fill.
    EOS is ignored by passing `eos_token_id=None` (no stopping criterion; `min_new_tokens` would
    instead mask the EOS logit and change greedy choices); the result is checked to be full length.
    """
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    lengths = sorted({len(p) for p in prompts})
    if len(lengths) > 1:
        raise ValueError(f"hf_generate batches prompts without padding: all must have one length, got lengths {lengths}")
    input_ids = torch.tensor(prompts, dtype=torch.long)
    if cache_len is None:
        cache_kw: dict[str, Any] = dict(cache_implementation=cache)
    elif cache != "static":
        raise ValueError(f"cache_len sizes a static cache; cache={cache!r} grows as it goes")
    elif cache_len < lengths[0] + max_new_tokens:
        raise ValueError(f"cache_len {cache_len} < prompt {lengths[0]} + max_new_tokens {max_new_tokens}")
    else:
        cache_kw = dict(cache=transformers.StaticCache(config=hf_model.config, max_cache_len=cache_len))
    clock = _TokenClock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=None,
            disable_compile=True,
            streamer=clock,
            **cache_kw,
        )
        seconds = time.perf_counter() - start
    tokens = out[:, input_ids.shape[1]:].tolist()
    if any(len(row) != max_new_tokens for row in tokens):
        raise RuntimeError(f"transformers generated {[len(r) for r in tokens]} tokens, expected {max_new_tokens} each")
    if len(clock.times) != max_new_tokens + 1:  # the prompt, then one put per generated token
        raise RuntimeError(f"the streamer saw {len(clock.times)} puts, expected {max_new_tokens + 1}")
    return HFRun(tokens=tokens, seconds=seconds, token_times=tuple(clock.times[1:]))


def hf_decode_tokens_per_second(hf_model: transformers.PreTrainedModel, prompts: list[list[int]],
                                max_new_tokens: int, *, cache: str, cache_len: int | None = None, repeats: int = 3,
                                warmup: bool = True) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of `generate`, the prefill excluded, and the generated tokens.

    Each run's rate is batch * (N - 1) / (time of token N - time of token 1): the N - 1 decode
    steps after the prefill, timed inside the one `generate` call (`HFRun.token_times`); the result
    is the median of `repeats` runs, after one untimed warm-up run unless `warmup=False` (the model
    already warm). The tokens are the first run's. `cache`, `cache_len`: as in `hf_generate`.
    """
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 to time a decode step, got {max_new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs = [hf_generate(hf_model, prompts, max_new_tokens, cache=cache, cache_len=cache_len)
            for _ in range(repeats + warmup)]
    rates = [len(prompts) * (max_new_tokens - 1) / r.decode_seconds for r in runs[warmup:]]
    return statistics.median(rates), runs[0].tokens
