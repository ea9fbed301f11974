"""The converted checkpoint format written by `randkv convert` and read by `load_model`.

    DIR/randkv.json      format version, the ModelConfig, the dtype the parameters were saved in
    DIR/params/          Orbax checkpoint of the parameter tree
    DIR/tokenizer.json   (and tokenizer_config.json) when the model has a tokenizer

Restoring reads the parameters straight into their final dtype and, given a mesh, straight
into their shards: no conversion pass and no full host copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from randkv_jax.models.config import ModelConfig
from randkv_jax.models.model import Model, abstract_params

FORMAT_VERSION = 1
MARKER = "randkv.json"


def is_converted(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_converted(model: Model, out_dir: str | Path) -> Path:
    """Write `model` (params, config, tokenizer) to `out_dir`, which must not exist yet."""
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", model.params)
    checkpointer.wait_until_finished()
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": jax.numpy.dtype(model.dtype).name,
        "config": model.config.to_dict(),
    }
    (out / MARKER).write_text(json.dumps(meta, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save(out)
    return out


def load_converted(directory: str | Path, dtype: Any, shardings_for=None) -> tuple[ModelConfig, Any]:
    """Restore (config, params) from a converted checkpoint, cast to `dtype`.

    `shardings_for(config)` may return a sharding tree; each leaf is restored into it.
    """
    directory = Path(directory).absolute()
    meta = json.loads((directory / MARKER).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{directory}: converted with format {meta.get('format_version')}, "
            f"this randkv_jax reads format {FORMAT_VERSION}; convert again"
        )
    config = ModelConfig.from_dict(meta["config"])
    abstract = abstract_params(config, dtype)
    if shardings_for is not None:
        shardings = shardings_for(config)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    params = ocp.StandardCheckpointer().restore(directory / "params", target)
    return config, params
