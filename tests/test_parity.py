"""Logits parity with transformers on tiny random checkpoints of every supported family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import randkv_jax
from randkv_jax.models import forward
from randkv_jax.models.model import positions_from_mask
from tests.hf_tiny import TINY, save_tiny

# bfloat16 runs round weights, activations and the residual stream to 8 bits of mantissa; on
# these tiny models (logits of magnitude ~3) the error against float32 transformers stays below
# this bound (measured max 0.032-0.052 over the configs here: `python -m tests.test_parity`).
BF16_ATOL = 0.1


def _batch(seq_len: int, vocab: int, pad: str):
    """Three rows of lengths seq_len, seq_len-3, seq_len-7 with left or right padding."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, vocab, size=(3, seq_len)).astype(np.int32)
    mask = np.ones((3, seq_len), np.int32)
    for row, n_pad in enumerate([0, 3, 7]):
        if n_pad:
            sl = slice(0, n_pad) if pad == "left" else slice(seq_len - n_pad, seq_len)
            mask[row, sl] = 0
            tokens[row, sl] = 0
    return tokens, mask


def _hf_logits(hf_model, tokens, mask):
    positions = np.asarray(positions_from_mask(mask))
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny(request.param, directory)
    return request.param, directory, hf_model


@pytest.mark.parametrize("pad", ["left", "right"])
def test_float32_logits_match_transformers(tiny, pad):
    name, directory, hf_model = tiny
    model = randkv_jax.load_model(directory, dtype="float32")
    # phi3_longrope switches to its long factors past 16 positions: test both regimes.
    for seq_len in (12, 40) if name == "phi3_longrope" else (24,):
        tokens, mask = _batch(seq_len, model.config.vocab_size, pad)
        ours = np.asarray(forward(model, tokens, mask))
        ref = _hf_logits(hf_model, tokens, mask)
        valid = mask.astype(bool)
        err = np.abs(ours - ref)[valid].max()
        assert err <= 1e-4, f"{name} pad={pad} T={seq_len}: max abs logits error {err}"


def test_bfloat16_logits_within_documented_tolerance(tiny):
    name, directory, hf_model = tiny
    model = randkv_jax.load_model(directory, dtype="bfloat16")
    tokens, mask = _batch(24, model.config.vocab_size, "right")
    ours = np.asarray(forward(model, tokens, mask))
    ref = _hf_logits(hf_model, tokens, mask)
    err = np.abs(ours - ref)[mask.astype(bool)].max()
    assert err <= BF16_ATOL, f"{name}: bf16 max abs logits error {err}"
    assert ours.dtype == np.float32


def report() -> None:
    """Print the measured max abs logits errors (the figures in docs/models.md)."""
    import tempfile
    from pathlib import Path

    for name in sorted(TINY):
        directory = Path(tempfile.mkdtemp())
        hf_model = save_tiny(name, directory)
        for dtype in ("float32", "bfloat16"):
            model = randkv_jax.load_model(directory, dtype=dtype)
            for seq_len in (12, 40) if name == "phi3_longrope" else (24,):
                errors = []
                for pad in ("left", "right"):
                    tokens, mask = _batch(seq_len, model.config.vocab_size, pad)
                    diff = np.abs(np.asarray(forward(model, tokens, mask)) - _hf_logits(hf_model, tokens, mask))
                    errors.append(diff[mask.astype(bool)].max())
                print(f"{name:14s} {dtype:9s} T={seq_len:2d}  max abs logits error {max(errors):.2e}")


if __name__ == "__main__":
    report()
