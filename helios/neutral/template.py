"""The core's chat template, rendered with jinja2 under Hugging Face semantics.

Same environment as transformers' apply_chat_template: an immutable sandbox with trim_blocks
and lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII text and accepts indent /
separators / sort_keys, `strftime_now`, and loop controls. Any failure while compiling or
rendering becomes a `TemplateError` (HTTP 400): a template is code the model author wrote, and
its refusals (raise_exception) are statements about the request.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from helios.manifest import Manifest
from helios.neutral.errors import RequestError

# Appended to the text being continued so we can find where the template put its end.
_CONTINUE_TAG = "FLARE_CONTINUE_FINAL_MESSAGE_TAG "

# Variables the renderer owns; chat_template_kwargs cannot replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})


class TemplateError(RequestError):
    """The template could not be compiled or refused to render this conversation."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON (HF overrides it too).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` without underscore attributes (no path to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may read."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None

    @classmethod
    def from_core(
        cls, core_dir: Path, manifest: Manifest, *, bos_token: str | None, eos_token: str | None
    ) -> ChatTemplate | None:
        if not manifest.template.file:
            return None
        source = (Path(core_dir) / manifest.template.file).read_text(encoding="utf-8")
        return cls(source, bos_token=bos_token, eos_token=eos_token)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render `messages` (plain template dicts) to prompt text."""
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt cannot both be true")
        kwargs = dict(template_kwargs or {})
        clash = sorted(RESERVED_VARIABLES.intersection(kwargs))
        if clash:
            raise TemplateError(f"chat_template_kwargs cannot set {', '.join(clash)}", param="chat_template_kwargs")
        variables: dict[str, Any] = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(kwargs)

        final_text: str | None = None
        if continue_final_message:
            messages, final_text = _tag_final_message(messages)
        try:
            rendered = self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template rejected the conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
            raise TemplateError(f"the chat template failed on the conversation: {exc}") from None
        if final_text is not None:
            rendered = _cut_after_final_message(rendered, final_text)
        return rendered


def _tag_final_message(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Copy messages with a tag after the final message's text (HF continue_final_message)."""
    if not messages:
        raise TemplateError("continue_final_message needs a final message to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        final_text = content
        last["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                final_text = part["text"]
                part["text"] = part["text"] + _CONTINUE_TAG
                break
        else:
            raise TemplateError("continue_final_message needs text in the final message")
        last["content"] = parts
    else:
        raise TemplateError("continue_final_message needs text in the final message")
    return [*messages[:-1], last], final_text


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered or final_text.strip() not in rendered:
        raise TemplateError("the chat template does not render the final message verbatim, so it cannot be continued")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed trailing whitespace after the content; trim what precedes the tag too.
    return rendered[:at].rstrip()
