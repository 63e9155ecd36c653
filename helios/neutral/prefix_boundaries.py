"""Candidate prefix-checkpoint boundaries of a rendered conversation (api.md, GPU checkpoints).

The engine may capture KV checkpoints only at positions the frontend offers
(`GenerationRequest.checkpoints`), so reuse never starts at an unmarked position inside a
message. A conversation offers:

- the conversation anchor: the end of the shared preamble (system, developer and tool
  definitions as the template renders them) before the first conversation message;
- message ends: the end of each of the last few whole rendered messages;
- client cache hints (Anthropic cache_control block ends, see helios.neutral.hints);
- the exact prompt endpoint.

Positions are found by rendering a prefix of the conversation through the same template with the
same options, and a boundary only counts when the prefix render is a text prefix of the full
render and its tokens are an exact prefix of the full prompt's tokens: then any later request
whose conversation starts the same way tokenizes to the same ids up to the boundary. Templates
that render earlier messages differently once more follow (for example by dropping reasoning)
simply produce fewer candidates. Raw completions offer the endpoint only.
"""

from __future__ import annotations

from typing import Any

from helios.engine.api import CheckpointCandidate, CheckpointRole
from helios.neutral.conversation import Conversation, Message, TextPart, render_text
from helios.neutral.errors import RequestError
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer

# Message ends beyond the most recent few were offered by the earlier requests of the same
# conversation; rendering every prefix would cost O(messages^2) per request.
MAX_MESSAGE_ENDS = 6
# User message texts that differ from their first character: where anchor probes diverge.
_PROBES = ("\ue000", "\ue001")


def endpoint(prompt_ids: list[int]) -> list[CheckpointCandidate]:
    return [CheckpointCandidate(len(prompt_ids), CheckpointRole.ENDPOINT)] if prompt_ids else []


def conversation_candidates(
    conversation: Conversation,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    *,
    hints: list[int] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[CheckpointCandidate]:
    """Every candidate boundary of a conversation prompt (sorted by position, one role each)."""
    out: dict[int, CheckpointRole] = {}

    def offer(position: int | None, role: CheckpointRole) -> None:
        if position is not None and 0 < position <= len(prompt_ids) and position not in out:
            out[position] = role

    for p in endpoint(prompt_ids):
        offer(p.position, p.role)
    if template is not None and prompt_ids:
        try:
            full = render_text(
                conversation,
                template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
            )
        except RequestError:
            full = None
        if full is not None:
            bounds = _Boundaries(full, prompt_ids, tokenizer)
            offer(_anchor(conversation, template, template_kwargs, bounds), CheckpointRole.ANCHOR)
            for position in hints or []:
                offer(position, CheckpointRole.HINT)
            for position in _message_ends(conversation, template, template_kwargs, bounds):
                offer(position, CheckpointRole.MESSAGE)
    else:
        for position in hints or []:
            offer(position, CheckpointRole.HINT)
    return [CheckpointCandidate(p, role) for p, role in sorted(out.items())]


class _Boundaries:
    """Maps prefix texts of the full render to exact prompt token positions."""

    def __init__(self, full: str, prompt_ids: list[int], tokenizer: Tokenizer):
        self.full = full
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer

    def exact(self, prefix: str) -> int | None:
        """Tokens of `prefix` when they are exactly the first tokens of the prompt."""
        if not prefix or not self.full.startswith(prefix):
            return None
        ids = self.tokenizer.encode(prefix, add_bos=False)
        n = len(ids)
        if 0 < n <= len(self.prompt_ids) and self.prompt_ids[:n] == ids:
            return n
        return None

    def within(self, chars: int) -> int | None:
        """The longest exact token prefix of the prompt inside the first `chars` characters."""
        limit = len(self.full[:chars].encode("utf-8"))
        total = count = 0
        for token in self.prompt_ids:
            size = len(self.tokenizer.token_bytes(token))
            if total + size > limit:
                break
            total += size
            count += 1
        if count == 0:
            return None
        data = b"".join(self.tokenizer.token_bytes(t) for t in self.prompt_ids[:count])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return self.exact(text)


def _anchor(
    conversation: Conversation, template: ChatTemplate, template_kwargs: dict[str, Any] | None, bounds: _Boundaries
) -> int | None:
    """End of the preamble: what two renders share whose first conversation message is a user
    probe with different text (templates place system text and tools before the first message,
    some insert a default system prompt, so the preamble is found by rendering, not assumed). It
    counts only when the full prompt starts with all of it, so the anchor never ends inside a
    message (say, a system message that merging instructions makes longer in the full render)."""
    messages = conversation.messages
    k = 0
    while k < len(messages) and messages[k].role in ("system", "developer"):
        k += 1
    if k == len(messages):
        return None  # no conversation message: the endpoint already covers the preamble
    renders = []
    for probe in _PROBES:
        probed = Conversation([*messages[:k], Message("user", [TextPart(probe)])], conversation.tools)
        try:
            renders.append(render_text(probed, template, add_generation_prompt=False, template_kwargs=template_kwargs))
        except RequestError:
            return None
    common = 0
    for a, b in zip(*renders):
        if a != b:
            break
        common += 1
    if not bounds.full.startswith(renders[0][:common]):
        return None
    return bounds.within(common)


def _message_ends(
    conversation: Conversation, template: ChatTemplate, template_kwargs: dict[str, Any] | None, bounds: _Boundaries
) -> list[int]:
    messages = conversation.messages
    first = 0
    while first < len(messages) and messages[first].role in ("system", "developer"):
        first += 1
    positions: list[int] = []
    for end in range(len(messages), max(first, len(messages) - MAX_MESSAGE_ENDS), -1):
        prefix = Conversation(messages[:end], conversation.tools)
        try:
            text = render_text(prefix, template, add_generation_prompt=False, template_kwargs=template_kwargs)
        except RequestError:
            continue
        position = bounds.exact(text)
        if position is not None:
            positions.append(position)
    return positions
