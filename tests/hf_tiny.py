"""Tiny random Hugging Face checkpoints (written by transformers' `save_pretrained`) for tests.

Every weight, norms included, is randomised so that a wrong transpose, split or norm shows up.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, kwargs); each exercises a different part of the decoder.
TINY = {
    "qwen3_tied": (transformers.Qwen3Config, dict(
        COMMON, head_dim=32, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen3_untied": (transformers.Qwen3Config, dict(
        COMMON, head_dim=16, rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    "qwen3_yarn": (transformers.Qwen3Config, dict(
        COMMON, head_dim=16, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32))),
    "phi3_partial": (transformers.Phi3Config, dict(
        COMMON, rope_parameters=dict(rope_type="default", rope_theta=250000.0, partial_rotary_factor=0.75),
        tie_word_embeddings=False, sliding_window=None)),
    "phi3_longrope": (transformers.Phi3Config, dict(
        COMMON, max_position_embeddings=64, tie_word_embeddings=False, sliding_window=None,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
            original_max_position_embeddings=16,
            short_factor=[1.0, 1.1, 1.3, 1.7], long_factor=[1.0, 2.0, 4.0, 8.0]))),
    "llama": (transformers.LlamaConfig, dict(
        COMMON, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama3_rope": (transformers.LlamaConfig, dict(
        COMMON, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))),
}


def build_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 HF model of the named tiny config with every parameter randomised."""
    cls, kwargs = TINY[name]
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:  # norm scales around 1
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval()


def save_tiny(name: str, directory: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """Write the tiny model to `directory` (config.json + model.safetensors) and return it."""
    model = build_hf_model(name, seed)
    model.save_pretrained(directory)
    return model


TEXT = " ".join(f"the {w} of step {i} is {i * 7 % 13} so we add {w} again." for i, w in
                enumerate(["sum", "value", "answer", "count", "root", "limit"] * 12))


def save_tokenizer(directory: Path, text: str = TEXT) -> None:
    """A small BPE tokenizer (vocab 200 < the tiny models' 256) trained on `text`, as tokenizer.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3: the tiny configs' pad, bos, eos
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=specials))
    tok.save(str(directory / "tokenizer.json"))
