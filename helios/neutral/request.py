"""Lowering a neutral request into engine requests: prompt ids, output plan, engine constraints.

Chat Completions, Messages and Responses decode their own JSON into a `Conversation` plus
`ChatOptions`; `lower` turns that into what the engine and the output pipeline need, so tool
choice, structured output and reasoning behave identically on every protocol:

1. tool choice: required/named checks, the presented tool definitions, the required-mode
   instruction; output constraints: the combination rules and the JSON-only instruction;
2. render through the prepared template (helios.neutral.conversation);
3. reasoning: where output starts (the rendered prompt), the budget rules, delimiter ids;
4. the output grammar (llguidance, compiled and validated before admission);
5. the candidate prefix-checkpoint boundaries (message ends, cache hints, the endpoint).

`engine_requests` is the one place engine requests are assembled (every protocol, raw prompts
included): one per choice, ids `{response_id}-{index}`, seeds advanced per choice.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from helios.engine.api import CheckpointCandidate, GenerationRequest, ImageInput, ReasoningControl, SamplingParams
from helios.manifest import Manifest
from helios.neutral.conversation import (
    Conversation,
    Part,
    ToolSpec,
    image_parts,
    render_text,
    template_order,
    with_instruction,
)
from helios.neutral.errors import RequestError
from helios.neutral.grammar import OutputFormat, compiler_for
from helios.neutral.hints import boundary_positions
from helios.neutral.images import expand_placeholders, prepare_images
from helios.neutral.parsers import (
    REASONING,
    TOOL_OPENER_TEXT,
    OutputSpec,
    resolve_reasoning,
    single_token,
    start_state,
)
from helios.neutral.prefix_boundaries import conversation_candidates
from helios.neutral.sampling import child_seed
from helios.neutral.template import ChatTemplate
from helios.neutral.thinking import Budget, check_effort
from helios.neutral.tokenizer import Tokenizer
from helios.neutral.tools import ToolChoice, presented, require_tools, with_required_instruction

log = logging.getLogger("helios.output")


@dataclass
class ChatOptions:
    """Neutral generation options of a conversational request."""

    tools: list[ToolSpec] = field(default_factory=list)  # every declared tool (model-facing names)
    choice: ToolChoice = field(default_factory=ToolChoice)
    output_format: OutputFormat | None = None
    output_format_param: str = "response_format"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final: bool = False
    budget: Budget = field(default_factory=Budget)
    user_stops: bool = False  # string or token stops were requested
    ignore_eos: bool = False
    cache_hints: list[Part] = field(default_factory=list)  # parts whose end is a checkpoint candidate


@dataclass
class OutputPlan:
    """How one request's generated text becomes its answer (per choice)."""

    spec: OutputSpec = field(default_factory=OutputSpec)
    tools: list[ToolSpec] = field(default_factory=list)  # presented tools
    choice: ToolChoice = field(default_factory=ToolChoice)


@dataclass
class Lowered:
    conversation: Conversation  # what was rendered (presented tools, added instructions)
    prompt_text: str
    prompt_ids: list[int]
    output: OutputPlan
    grammar: str | None = None
    reasoning: ReasoningControl | None = None
    checkpoints: list[CheckpointCandidate] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images, in prompt order

    def requests(
        self, response_id: str, sampling: SamplingParams, choices: int = 1, prompt_logprobs: int | None = None
    ) -> list[GenerationRequest]:
        """One engine request per choice; the shared prompt is scored once (the first choice)."""
        return engine_requests(
            response_id,
            self.prompt_ids,
            sampling,
            choices=choices,
            checkpoints=self.checkpoints,
            grammar=self.grammar,
            reasoning=self.reasoning,
            prompt_logprobs=prompt_logprobs,
            scored_choices=1,
            images=self.images,
        )


def engine_requests(
    response_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    choices: int = 1,
    first_index: int = 0,
    checkpoints: list[CheckpointCandidate] | None = None,
    grammar: str | None = None,
    reasoning: ReasoningControl | None = None,
    prompt_logprobs: int | None = None,
    scored_choices: int | None = None,
    images: list[ImageInput] | None = None,
) -> list[GenerationRequest]:
    """One prompt's engine requests: choice j is `{response_id}-{first_index + j}` with the seed
    advanced by j (n > 1 stays reproducible); the first `scored_choices` (default all) score it."""
    scored = choices if scored_choices is None else scored_choices
    return [
        GenerationRequest(
            request_id=f"{response_id}-{first_index + j}",
            prompt_token_ids=prompt_ids,
            sampling=dataclasses.replace(sampling, seed=child_seed(sampling.seed, j)),
            checkpoints=list(checkpoints or []),
            grammar=grammar,
            reasoning=reasoning,
            prompt_logprobs=prompt_logprobs if j < scored else None,
            images=list(images or []),
        )
        for j in range(choices)
    ]


def lower(
    conversation: Conversation,
    options: ChatOptions,
    *,
    manifest: Manifest,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    default_budget: int | None = None,
    prepare: bool = True,
) -> Lowered:
    """`prepare` False renders the prompt only (count_tokens): no grammar, no checkpoints."""
    check_encoder_rules(conversation, options, manifest)
    choice = options.choice
    require_tools(choice, options.tools)
    tools = presented(options.tools, choice)
    if tools and not manifest.template.supports_tools:
        raise RequestError("this model core's chat template does not support tools", param="tools")
    fmt = options.output_format
    if fmt is not None:
        param = options.output_format_param
        if options.continue_final:
            raise RequestError("an output constraint cannot be combined with assistant continuation", param=param)
        if options.user_stops:
            raise RequestError("an output constraint cannot be combined with custom stops", param=param)
        if options.ignore_eos:
            raise RequestError("ignore_eos cannot be combined with an output constraint", param="ignore_eos")

    effective = Conversation(conversation.messages, tools)
    effective = with_required_instruction(effective, choice)
    if fmt is not None and (instruction := fmt.instruction(with_tools=bool(tools))):
        effective = with_instruction(effective, instruction)

    images = prepare_images(image_parts(template_order(effective, template)) if template else [], manifest)
    prompt_text = render_text(
        effective,
        template,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final,
        template_kwargs=options.template_kwargs,
    )
    # The template writes its own BOS/control tokens (HF and vLLM encode without extras).
    prompt_ids = tokenizer.encode(prompt_text, add_bos=False)
    log.debug("rendered prompt: %r", prompt_text)

    reasoning = resolve_reasoning(manifest.parsers.reasoning, tokenizer)
    start = start_state(reasoning, prompt_text)
    budget = _budget(
        options.budget,
        default_budget,
        reasoning is not None,
        start == REASONING,
        reasoning is not None and reasoning.close_id is not None,
    )
    control = None
    if reasoning is not None:
        tool_syntax = manifest.parsers.tool if tools else None
        openers = TOOL_OPENER_TEXT.get(tool_syntax or "", ()) if reasoning.syntax.tool_ends_reasoning else ()
        opener_ids = [i for i in (single_token(tokenizer, t) for t in openers) if i is not None]
        control = ReasoningControl(
            open_token_id=reasoning.open_id,
            close_token_id=reasoning.close_id,
            starts_open=start == REASONING,
            budget=budget,
            tool_open_ids=opener_ids,
            tool_open_texts=list(openers),
        )
    spec = OutputSpec(
        tool_syntax=manifest.parsers.tool if tools else None,
        schemas={t.name: t.parameters for t in tools},
        reasoning=reasoning,
        start=start,
        verbatim=fmt is not None,
    )
    grammar = None
    if fmt is not None and prepare:
        after_results = bool(conversation.messages) and conversation.messages[-1].role == "tool"
        grammar = compiler_for(tokenizer, manifest).output_grammar(
            fmt,
            spec.tool_syntax,
            {t.name: t.parameters for t in tools},
            options.output_format_param,
            bare_calls=not after_results,
        )
    checkpoints = _checkpoints(effective, options, template, tokenizer, prompt_ids) if prepare else []
    inputs: list[ImageInput] = []
    if images:
        assert manifest.vision is not None
        prompt_ids, inputs, moved = expand_placeholders(prompt_ids, images, manifest.vision.image_token_id)
        checkpoints = [dataclasses.replace(c, position=moved[c.position]) for c in checkpoints]
    return Lowered(
        effective, prompt_text, prompt_ids, OutputPlan(spec, tools, choice), grammar, control, checkpoints, inputs
    )


def check_encoder_rules(conversation: Conversation, options: ChatOptions, manifest: Manifest) -> None:
    """What the core's native encoder refuses (manifest `template.rejects`, DeepSeek V4/V4.1) is a
    400 here, before rendering; its explicit reasoning_effort kwarg is validated like the
    top-level field (an integer score only where the template takes one; null: the default)."""
    rejects = manifest.template.rejects
    if not rejects:
        return
    kwargs = options.template_kwargs
    if "drop_thinking" in rejects and "drop_thinking" in kwargs:
        raise RequestError("drop_thinking is not supported by this model core's encoder", param="chat_template_kwargs")
    ends_with_assistant = bool(conversation.messages) and conversation.messages[-1].role == "assistant"
    if "continuation" in rejects and (options.continue_final or ends_with_assistant):
        raise RequestError(
            "assistant continuation (a final assistant message) is not supported by this model core's encoder",
            param="messages",
        )
    if "add_generation_prompt_false" in rejects and not options.add_generation_prompt:
        raise RequestError(
            "add_generation_prompt=false is not supported by this model core's encoder", param="add_generation_prompt"
        )
    check_effort(
        kwargs.get("reasoning_effort"), "chat_template_kwargs.reasoning_effort", manifest.template.numeric_effort
    )


def _checkpoints(
    rendered: Conversation,
    options: ChatOptions,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
) -> list[CheckpointCandidate]:
    render = {
        "add_generation_prompt": options.add_generation_prompt,
        "continue_final_message": options.continue_final,
        "template_kwargs": options.template_kwargs,
    }
    hints = (
        boundary_positions(rendered, options.cache_hints, template, tokenizer, prompt_ids, **render)
        if options.cache_hints
        else []
    )
    return conversation_candidates(rendered, template, tokenizer, prompt_ids, hints=hints, **render)


def _budget(budget: Budget, default: int | None, has_syntax: bool, starts_open: bool, single_close: bool) -> int | None:
    """The engine cap, after api.md's rules: an explicit budget needs reasoning syntax, and a
    one-token close when output starts in reasoning; output that starts in content is never cut.
    Messages budgets are advisory where no cap is possible; the server default fills an omitted
    budget."""
    tokens = budget.tokens
    if tokens is not None and budget.explicit and not budget.advisory:
        if not has_syntax:
            raise RequestError(
                "thinking_token_budget needs a model core with reasoning syntax", param="thinking_token_budget"
            )
        if starts_open and not single_close:
            raise RequestError(
                "thinking_token_budget needs a reasoning close delimiter that is one token",
                param="thinking_token_budget",
            )
    if tokens is None:
        tokens = default
    if tokens is None or not (has_syntax and starts_open and single_close):
        return None
    return tokens
