"""Tokenizer and chat template for the gateway, without transformers.

Loads `tokenizer.json` with the `tokenizers` library and `tokenizer_config.json` for the chat
template and special tokens. The template is rendered in a sandboxed jinja2 environment with
the Hugging Face conventions (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
`raise_exception`); the rendered text already carries the template's special tokens, so it is
encoded without adding more, and special tokens written in it are recognized as such.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from gateway.errors import BadRequest


class TokenizerLoadError(ValueError):
    """The tokenizer directory is missing a file or holds an unreadable one."""


class TemplateError(BadRequest):
    """The chat template refused the messages (its `raise_exception`) or failed to render."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as "text" or {"content": "text", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode prompts, render chat messages, and expose the ids the detokenizer needs."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self.hf = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.special_ids: frozenset[int] = frozenset(
            tid for tid, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        self._template = self._compile(config.get("chat_template"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(
                f"gateway.model_path: {tok_file} not found; point model_path at a HF model directory with tokenizer.json"
            )
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise TokenizerLoadError(f"gateway.model_path: cannot read {tok_file}: {exc}") from exc
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        if "chat_template" not in config and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        return cls(hf, config)

    @staticmethod
    def _compile(source: Any) -> jinja2.Template | None:
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not source:
            return None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(source)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise BadRequest("this model has no chat template; use /v1/completions", param="messages")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise BadRequest(f"chat template failed to render: {exc}", param="messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes bos and the role markers itself; adding them again would double them.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.hf.id_to_token(token_id) or ""
