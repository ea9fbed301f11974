"""Tokenizer: a Rust `tokenizers` tokenizer plus a jinja2 chat template, rendered the way transformers does.

No torch/transformers at run time. Files: `tokenizer.json`, optional `tokenizer_config.json` (special tokens,
`chat_template`) and optional `chat_template.jinja` (transformers 5 layout; it wins over the config's template,
as in transformers).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers passes into every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """Raised by a chat template's `raise_exception(message)`."""


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` block, as a no-op: renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compile `template` in transformers' sandboxed environment (trim/lstrip blocks, loopcontrols, generation)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config: a string, an AddedToken-style `{"content": ...}` dict, or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unsupported special-token entry {value!r}: expected a string or a dict with 'content'")


def _ids(ids: Any) -> list[int]:
    """Token ids (list, numpy or jax array of shape [T]) -> list[int]."""
    return np.asarray(ids, dtype=np.int64).reshape(-1).tolist()


class Tokenizer:
    """Text <-> token ids plus chat-template rendering.

    Args:
        tokenizer: the Rust tokenizer (e.g. `tokenizers.Tokenizer.from_file(...)`, or one built in memory).
        chat_template: jinja2 source, or None (then `apply_chat_template` raises).
        special_tokens: {"bos_token": str, "eos_token": str | [str, ...], "pad_token": str, ...} (names in
            `SPECIAL_TOKEN_NAMES`; values may also be AddedToken-style dicts or None). Each must be in the vocabulary.
        config: other tokenizer_config.json entries, kept as they are by `save`.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = tokenizer
        self.chat_template = chat_template
        self.config = dict(config or {})
        self.special_tokens: dict[str, str] = {}  # name -> token string (first one for a list of eos tokens)
        self.eos_tokens: list[str] = []
        for name, value in (special_tokens or {}).items():
            if name not in SPECIAL_TOKEN_NAMES:
                raise ValueError(f"unknown special token {name!r}; expected one of {', '.join(SPECIAL_TOKEN_NAMES)}")
            many = name == "eos_token" and isinstance(value, (list, tuple))
            values = [_token_content(v) for v in value] if many else [_token_content(value)]
            values = [v for v in values if v is not None]
            for v in values:
                if tokenizer.token_to_id(v) is None:
                    raise ValueError(f"{name} {v!r} is not in the tokenizer's vocabulary")
            if values:
                self.special_tokens[name] = values[0]
            if name == "eos_token":
                self.eos_tokens = values

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ optional `tokenizer_config.json`, `chat_template.jinja`) from directory `path`."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        if not (path / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"{TOKENIZER_FILE} not found in {path} (only fast-tokenizer files are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as e:  # the Rust error is a plain Exception
            raise ValueError(f"cannot parse {path / TOKENIZER_FILE}: {e}") from None
        config: dict[str, Any] = {}
        if (path / CONFIG_FILE).is_file():
            try:
                config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"cannot parse {path / CONFIG_FILE}: {e}") from None
        template = config.pop("chat_template", None)
        if isinstance(template, list):  # old multi-template format: [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (path / TEMPLATE_FILE).is_file():
            template = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
        special = {name: config.pop(name) for name in SPECIAL_TOKEN_NAMES if name in config}
        return cls(backend, template, special, config)

    def save(self, path: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (chat template, special tokens) into directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / TOKENIZER_FILE))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config, **self.special_tokens}
        if len(self.eos_tokens) > 1:
            config["eos_token"] = list(self.eos_tokens)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # --- ids ---------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (transformers' `len(tok)`, not its `vocab_size`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids of the eos token(s); [] when none is set."""
        return [self.backend.token_to_id(t) for t in self.eos_tokens]

    # --- text --------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """str -> token ids [T]; `add_special_tokens` applies tokenizer.json's post-processor (e.g. a bos)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """Token ids [T] (list or array) -> str."""
        return self.backend.decode(_ids(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Iterable[Any], skip_special_tokens: bool = True) -> list[str]:
        """Rows of token ids ([B, T] array or ragged lists) -> B strings."""
        return self.backend.decode_batch([_ids(row) for row in batch], skip_special_tokens=skip_special_tokens)

    # --- chat --------------------------------------------------------------------------------------------
    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                             f"and no {TEMPLATE_FILE})")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) -> prompt str, or its ids [T] if `tokenize`.

        Extra keyword arguments (e.g. Qwen3's `enable_thinking=False`) reach the template, overriding the special
        token strings. Ids are encoded without adding special tokens again, as transformers does.
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = []
        for message in messages:  # as transformers: drop None values, alias the reasoning fields
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        context = {**self.special_tokens, **template_kwargs}
        text = self._compiled_template.render(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **context
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_prompt(self, user_text: str, system: str | None = None, **kw: Any) -> str | list[int]:
        """One user turn (after an optional system prompt) -> `apply_chat_template(...)` with `kw` passed on."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user_text})
        return self.apply_chat_template(messages, **kw)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens}, "
                f"eos_token_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_template else 'no'})")
