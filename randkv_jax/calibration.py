"""TriAttention calibration: per-(layer, query head) RoPE-frequency statistics of the queries.

What is computed (TriAttention, arXiv 2604.04921; repo WeianMao/triattention at c3744ee6,
`scripts/calibrate.py` L173-236 and `triattention/methods/pruning_utils.py` L51-98):
one forward pass over up to ~32k tokens of plain text; every layer's queries are taken as the
attention sees them (after `q_norm` for Qwen3, after RoPE), RoPE is inverted with the cos/sin of
their token positions, and the rotary dims are split into r/2 complex frequency pairs in the
"half" layout (real = dims[:r/2], imag = dims[r/2:r]; RoPE multiplies pair f by
exp(i * omega_f * position) times the attention scaling s). Per (layer, query head, f):

    q_mean[f]     = E_tokens[q_f]      (complex mean)
    q_abs_mean[f] = E_tokens[|q_f|]

Differences from the released script, on purpose: it hooks `q_proj` and applies RoPE itself, so
Qwen3's `q_norm` is skipped (calibrate.py L181-188); here queries are captured inside the real
forward pass (a custom `attend` of `models.decoder.Decoder`), `q_norm` included. Its statistics
also carry an extra factor s (it applies the scaling twice and removes it once, L187-188 and
L59-62); here they are the exact pre-RoPE queries. A factor common to all keys of a head does not
change TriAttention's z-normalised ranking. The text may be split into several sequences
(`chunk` tokens each, positions restarting at 0) to bound memory; by default it is one sequence,
whose attention is computed in query blocks so that 32k tokens fit.

Saved to a directory (default `<checkpoint>/triattention_stats`):
  - `stats.npz`: q_mean_real, q_mean_imag, q_abs_mean [l, h, r/2] float32; inv_freq [r/2]
    float32 (the model's RoPE omega_f); attention_scaling [] float32 (s);
  - `stats.json`: format/version, the model config fingerprint and shapes, RoPE type/style,
    the source text's name and sha256, token and sequence counts, dtype.
`load_stats(path)` returns a `CalibrationStats`: hashable by (directory, content digest), so a
policy holding it stays a valid `jax.jit` static argument, and recalibrating into the same
directory yields a different key.

Partial rotary (Phi-3/Phi-4 style) and longrope are refused: TriAttention's score is defined for
every head dim rotated at one fixed set of frequencies.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from randkv_jax.models.config import ModelConfig
from randkv_jax.models.decoder import Decoder, dense_attention
from randkv_jax.models.model import Model
from randkv_jax.models.rope import inverse_frequencies, rope_angles

FORMAT = "randkv-triattention-stats"
VERSION = 1
STATS_FILE = "stats.npz"
META_FILE = "stats.json"
DEFAULT_DIRNAME = "triattention_stats"
QUERY_BLOCK = 512  # queries per block of the calibration forward's attention


def default_stats_dir(model_path: str | Path) -> Path:
    """Where `randkv calibrate` saves by default: next to the checkpoint."""
    path = Path(model_path)
    return path / DEFAULT_DIRNAME if path.is_dir() else path.parent / f"{path.stem}.{DEFAULT_DIRNAME}"


def config_fingerprint(config: ModelConfig) -> str:
    """sha256 of the config fields that define the model's queries (not its dtype or token ids)."""
    fields = dataclasses.asdict(config)
    for name in ("checkpoint_dtype", "bos_token_id", "eos_token_ids", "pad_token_id"):
        fields.pop(name)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def check_supported(config: ModelConfig) -> None:
    """Refuse what TriAttention's frequency statistics do not cover."""
    if config.rotary_dim != config.head_dim:
        raise ValueError(
            f"TriAttention needs RoPE on every head dim; this model rotates {config.rotary_dim} of "
            f"{config.head_dim} (partial rotary is not supported)"
        )
    if config.rope.rope_type == "longrope":
        raise ValueError("TriAttention does not support longrope (its frequencies change with the sequence length)")


@dataclasses.dataclass(frozen=True)
class CalibrationStats:
    """Loaded statistics; equality and hash are (directory, digest of stats.npz)."""

    path: str
    digest: str
    q_mean_real: np.ndarray = dataclasses.field(compare=False, repr=False)
    """[l, h, f] float32, f = rotary_dim / 2."""
    q_mean_imag: np.ndarray = dataclasses.field(compare=False, repr=False)
    """[l, h, f] float32."""
    q_abs_mean: np.ndarray = dataclasses.field(compare=False, repr=False)
    """[l, h, f] float32."""
    inv_freq: np.ndarray = dataclasses.field(compare=False, repr=False)
    """[f] float32: RoPE omega_f."""
    attention_scaling: float = dataclasses.field(compare=False, repr=False)
    """RoPE attention scaling s (1 for plain RoPE)."""
    meta: dict = dataclasses.field(compare=False, repr=False)
    """The contents of stats.json."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, query heads, frequencies)."""
        return self.q_abs_mean.shape

    def check_model(self, config: ModelConfig) -> None:
        """Raise ValueError unless these statistics were computed for `config`'s architecture."""
        if self.meta["model_config_sha256"] != config_fingerprint(config):
            raise ValueError(
                f"TriAttention statistics {self.path} were computed for another model "
                f"({self.meta['num_layers']} layers, {self.meta['num_heads']} heads x {self.meta['head_dim']}, "
                f"config sha256 {self.meta['model_config_sha256'][:12]}); this one has {config.num_layers} layers, "
                f"{config.num_heads} heads x {config.head_dim}: run `randkv calibrate` for it"
            )


def _blocked_causal(q, k, v, block: int):
    """Causal attention of q [b, t, h, d] over k, v [b, t, k, d], `block` queries at a time."""
    b, t = q.shape[:2]
    if t <= block:
        return dense_attention(q, k, v, jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0))

    def one(start):
        qi = jax.lax.dynamic_slice_in_dim(q, start, block, axis=1)
        mask = jnp.arange(t)[None, :] <= (start + jnp.arange(block))[:, None]
        return dense_attention(qi, k, v, jnp.broadcast_to(mask[None], (b, block, t)))

    ctx = jax.lax.map(one, jnp.arange(0, t, block))  # [t / block, b, block, h, d]
    return ctx.transpose(1, 0, 2, 3, 4).reshape(q.shape)


def unrotate_pairs(
    x: Float[Array, "*batch t n d"], cos: Float[Array, "*batch t r"], sin: Float[Array, "*batch t r"], scaling: float
) -> tuple[Float[Array, "*batch t n f"], Float[Array, "*batch t n f"]]:
    """Post-RoPE vectors -> pre-RoPE complex pairs (real, imag), f = r / 2, float32.

    `cos`/`sin` are `rope_angles` tables (scaling folded in): pair f of the rotated vector is
    s * z_f * exp(i theta_f), so z_f = rotated_f * (cos - i sin) / s^2.
    """
    f = cos.shape[-1] // 2
    x = x.astype(jnp.float32)
    re, im = x[..., :f], x[..., f : 2 * f]
    c, s = cos[..., None, :f], sin[..., None, :f]
    inv = 1.0 / scaling**2
    return (re * c + im * s) * inv, (im * c - re * s) * inv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeTables:
    """The calibration pass's `Attend` inputs: the sequence's RoPE tables (scaling folded in)."""

    cos: Float[Array, "1 t r"]
    sin: Float[Array, "1 t r"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuerySums:
    """The calibration pass's cache: per-layer sums of the pre-RoPE query pairs."""

    real: Float[Array, "l h f"]
    imag: Float[Array, "l h f"]
    abs: Float[Array, "l h f"]


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _sequence_sums(params, tokens: Int[Array, "1 t"], n_valid, *, config: ModelConfig, dtype: Any):
    """Sums over the first `n_valid` tokens of (Re q_f, Im q_f, |q_f|) per layer and head: 3 x [l, h, f]."""
    t = tokens.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = rope_angles(config, positions)
    _, scaling = inverse_frequencies(config)
    valid = (positions < n_valid)[..., None, None]  # [1, t, 1, 1]
    block = min(QUERY_BLOCK, t)

    def attend(q, k, v, inputs: RopeTables, sums: QuerySums, layer):
        re, im = unrotate_pairs(q, inputs.cos, inputs.sin, scaling)
        add = lambda acc, x: acc.at[layer].set(jnp.where(valid, x, 0.0).sum(axis=(0, 1)))  # noqa: E731
        sums = QuerySums(add(sums.real, re), add(sums.imag, im), add(sums.abs, jnp.sqrt(re * re + im * im)))
        return _blocked_causal(q, k, v, block), sums

    zeros = jnp.zeros((config.num_layers, config.num_heads, config.rotary_dim // 2), jnp.float32)
    decoder = Decoder(config, dtype, dtype, attend=attend)
    _, sums = decoder.apply(
        {"params": params}, tokens, positions, RopeTables(cos, sin), QuerySums(zeros, zeros, zeros),
        logit_index=jnp.zeros((1,), jnp.int32),
    )
    return sums.real, sums.imag, sums.abs


def query_statistics(model: Model, token_ids: Sequence[int], chunk: int | None = None) -> dict[str, np.ndarray]:
    """q_mean_real, q_mean_imag, q_abs_mean [l, h, r/2] float32 over `token_ids`.

    The ids are cut into sequences of `chunk` tokens (default: one sequence), each run from
    position 0; the last one is padded, its padding excluded from the means.
    """
    check_supported(model.config)
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    if ids.size == 0:
        raise ValueError("calibration needs at least one token")
    if ids.min() < 0 or ids.max() >= model.config.vocab_size:
        raise ValueError(f"token ids must lie in [0, {model.config.vocab_size})")
    chunk = ids.size if chunk is None else int(chunk)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    length = -(-chunk // QUERY_BLOCK) * QUERY_BLOCK if chunk > QUERY_BLOCK else chunk
    totals = [0.0, 0.0, 0.0]
    for start in range(0, ids.size, chunk):
        piece = ids[start : start + chunk]
        tokens = np.zeros((1, length), np.int32)
        tokens[0, : piece.size] = piece
        sums = _sequence_sums(model.params, jnp.asarray(tokens), jnp.int32(piece.size),
                              config=model.config, dtype=model.dtype)
        totals = [acc + np.asarray(x, np.float64) for acc, x in zip(totals, sums)]
    mean_re, mean_im, abs_mean = (x / ids.size for x in totals)
    return {
        "q_mean_real": mean_re.astype(np.float32),
        "q_mean_imag": mean_im.astype(np.float32),
        "q_abs_mean": abs_mean.astype(np.float32),
    }


def save_stats(out_dir: str | Path, config: ModelConfig, stats: dict[str, np.ndarray], **source: Any) -> Path:
    """Write stats.npz and stats.json for `config` into `out_dir` (created; files replaced)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inv_freq, scaling = inverse_frequencies(config)
    np.savez(out / STATS_FILE, **{k: np.asarray(v, np.float32) for k, v in stats.items()},
             inv_freq=inv_freq.astype(np.float32), attention_scaling=np.float32(scaling))
    meta = {
        "format": FORMAT, "version": VERSION, "model_config_sha256": config_fingerprint(config),
        "architecture": config.architecture, "num_layers": config.num_layers, "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "rotary_dim": config.rotary_dim,
        "rope_type": config.rope.rope_type, "rope_style": "half", **source,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def calibrate(
    model: Model, token_ids: Sequence[int], out_dir: str | Path, *, chunk: int | None = None, **source: Any
) -> Path:
    """Compute the statistics over `token_ids` and save them to `out_dir`; `source` goes to stats.json."""
    stats = query_statistics(model, token_ids, chunk)
    n = len(token_ids)
    return save_stats(out_dir, model.config, stats, tokens=n, sequences=-(-n // (chunk or n)),
                      sequence_length=chunk or n, dtype=jnp.dtype(model.dtype).name, **source)


def calibrate_text(
    model: Model, text_path: str | Path, out_dir: str | Path, *, max_tokens: int = 32768, chunk: int | None = None
) -> Path:
    """Tokenize a plain-text file with the model's tokenizer (first `max_tokens` ids) and calibrate."""
    text_path = Path(text_path)
    if not text_path.is_file():
        raise FileNotFoundError(f"calibration text not found: {text_path}")
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer: calibration needs one to encode the text")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    raw = text_path.read_bytes()
    ids = model.tokenizer.encode(raw.decode("utf-8"))[:max_tokens]
    return calibrate(model, ids, out_dir, chunk=chunk, text_file=text_path.name,
                     text_sha256=hashlib.sha256(raw).hexdigest())


def resolve_stats_dir(path: str | Path) -> Path:
    """A stats directory, or a checkpoint directory holding one in `triattention_stats/`."""
    path = Path(path)
    for candidate in (path, path / DEFAULT_DIRNAME):
        if (candidate / STATS_FILE).is_file() and (candidate / META_FILE).is_file():
            return candidate
    raise FileNotFoundError(
        f"no TriAttention statistics at {path} (expected {STATS_FILE} and {META_FILE}); "
        f"compute them with `randkv calibrate --model CHECKPOINT --text FILE`"
    )


def load_stats(path: str | Path) -> CalibrationStats:
    """Load the statistics saved in directory `path` (or in `path/triattention_stats`)."""
    directory = resolve_stats_dir(path)
    raw = (directory / STATS_FILE).read_bytes()
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{directory / META_FILE}: not {FORMAT} version {VERSION}")
    with np.load(directory / STATS_FILE) as data:
        arrays = {k: np.asarray(data[k], np.float32) for k in data.files}
    expected = (meta["num_layers"], meta["num_heads"], meta["rotary_dim"] // 2)
    for name in ("q_mean_real", "q_mean_imag", "q_abs_mean"):
        if arrays[name].shape != expected:
            raise ValueError(f"{directory / STATS_FILE}: {name} has shape {arrays[name].shape}, expected {expected}")
    if meta["rotary_dim"] != meta["head_dim"]:
        raise ValueError(f"{directory}: statistics for partial rotary are not supported")
    return CalibrationStats(
        path=str(directory.resolve()), digest=hashlib.sha256(raw).hexdigest(),
        q_mean_real=arrays["q_mean_real"], q_mean_imag=arrays["q_mean_imag"], q_abs_mean=arrays["q_abs_mean"],
        inv_freq=arrays["inv_freq"], attention_scaling=float(arrays["attention_scaling"]), meta=meta,
    )
