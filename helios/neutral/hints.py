"""Prompt positions of client cache hints (Anthropic cache_control) for prefix checkpoints.

A hint marks the end of a conversation part. The template decides where that end lands in the
prompt, so we render once more with an invisible marker after each hinted part, find the
markers' character offsets, and convert them to token positions by walking the prompt's exact
token bytes. The position is the number of whole prompt tokens before the boundary, so a
checkpoint there is always a true prefix of the prompt even when a token spans the boundary.
Hints are advisory: whenever the template transforms the text so that offsets cannot be proven
to match the real prompt, no position is produced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from helios.neutral.conversation import (
    Conversation,
    ImagePart,
    Message,
    Part,
    TextPart,
    ToolResultPart,
    render_text,
)
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer

# Private-use code points: never produced by tokenizers' normalizers or chat templates.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _marker(i: int) -> str:
    return f"{_OPEN}{i}{_CLOSE}"


def _marked(part: Part, marker: str) -> Part:
    if isinstance(part, TextPart):
        return TextPart(part.text + marker)
    if isinstance(part, ImagePart) and part.placeholder is not None:  # after the image's placeholder
        return dataclasses.replace(part, placeholder=part.placeholder + marker)
    if isinstance(part, ToolResultPart):
        content = list(part.content)
        if content:
            content[-1] = _marked(content[-1], marker)
        else:
            content.append(TextPart(marker))
        return dataclasses.replace(part, content=content)
    return part


def boundary_positions(
    conversation: Conversation,
    hinted: list[Part],
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    **render: Any,
) -> list[int]:
    """Sorted distinct token positions (0 < p < len(prompt_ids)) that end a hinted part."""
    if not hinted or template is None:
        return []
    markers = {id(part): _marker(i) for i, part in enumerate(hinted)}
    messages = [
        Message(m.role, [_marked(p, markers[id(p)]) if id(p) in markers else p for p in m.parts], name=m.name)
        for m in conversation.messages
    ]
    marked = render_text(Conversation(messages, conversation.tools), template, **render)
    offsets: list[int] = []  # character offsets in the unmarked text
    clean: list[str] = []
    cursor = removed = 0
    while (start := marked.find(_OPEN, cursor)) >= 0:
        end = marked.find(_CLOSE, start)
        if end < 0:
            return []
        clean.append(marked[cursor:start])
        offsets.append(start - removed)
        removed += end + 1 - start
        cursor = end + 1
    clean.append(marked[cursor:])
    text = "".join(clean)
    pieces = [tokenizer.token_bytes(t) for t in prompt_ids]
    if b"".join(pieces) != text.encode("utf-8"):
        return []  # the prompt does not spell this text byte for byte: offsets cannot be trusted
    piece_bytes = [len(piece) for piece in pieces]
    positions = set()
    for offset in offsets:
        limit = len(text[:offset].encode("utf-8"))
        total = count = 0
        for size in piece_bytes:
            if total + size > limit:
                break
            total += size
            count += 1
        if 0 < count < len(prompt_ids):
            positions.add(count)
    return sorted(positions)
