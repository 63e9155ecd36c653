"""The one scorer behind POST /v1/systemone and POST /v1/decisions (api.md).

A request is a shared state plus independent questions. Each question becomes one ordinary
conversation: the state in a first user message (so its end is a message checkpoint every later
question reuses), then the question with its options under synthetic single-token labels and an
`Answer:` cue, rendered with the normal assistant generation prompt and thinking disabled. The
labels are verified to be distinct single tokens right after that exact rendered prompt; the
engine then generates one token with `logprob_token_ids` = the labels, which returns each label's
full-vocabulary logprob (api.md "Generation log probabilities"). Questions run one after another.

This module is protocol-neutral: it compiles questions into engine requests and turns label
logprobs into answers. The two protocol modules decode and encode around it.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass, field
from typing import Any

from helios.engine.api import GenerationRequest, SamplingParams
from helios.manifest import Manifest
from helios.neutral.assets import Asset, split_assets
from helios.neutral.conversation import Conversation, Message
from helios.neutral.errors import RequestError
from helios.neutral.request import ChatOptions, engine_requests, lower
from helios.neutral.template import ChatTemplate
from helios.neutral.tokenizer import Tokenizer

# Synthetic labels in the order they are handed out; a tokenizer that splits some of them
# lowers the number of options a question may have.
LABEL_ALPHABET = list(string.ascii_uppercase) + list(string.ascii_lowercase) + list(string.digits)
MAX_QUESTIONS = 64


@dataclass
class Option:
    text: str  # what the model reads for this option
    description: str | None = None


# A yes/no question's options, true first (System One noul, Decisions predicate).
BINARY_OPTIONS = (Option("Yes / true"), Option("No / false"))


@dataclass
class Question:
    kind: str  # "binary" (true first, false second), "choice" or "score" (levels in order)
    instructions: str
    options: list[Option]


@dataclass
class Scored:
    """One question's label distribution."""

    logprobs: list[float]  # full-vocabulary logprob of each option's label, option order
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def mass(self) -> float:
        """Total raw probability of the labels (how much of the distribution they hold)."""
        return sum(math.exp(lp) for lp in self.logprobs)

    @property
    def probabilities(self) -> list[float]:
        """Label probabilities normalized over the labels (first-option safe when all are -inf)."""
        top = max(self.logprobs)
        if not math.isfinite(top):
            return [1.0 / len(self.logprobs)] * len(self.logprobs)
        weights = [math.exp(lp - top) for lp in self.logprobs]
        total = sum(weights)
        return [w / total for w in weights]


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def add(self, scored: Scored) -> None:
        self.input_tokens += scored.prompt_tokens
        self.output_tokens += scored.output_tokens
        self.cached_tokens += scored.cached_tokens


@dataclass
class CompiledQuestion:
    request: GenerationRequest
    label_ids: list[int]


@dataclass
class Scorer:
    manifest: Manifest
    tokenizer: Tokenizer
    template: ChatTemplate | None
    labels: list[str] = field(default_factory=list)  # usable label strings, filled by check_core
    assets: list[Asset] = field(default_factory=list)  # System One image assets the texts refer to

    def check_core(self) -> None:
        """400 for a core the scorer cannot use (no explicit-ID logprob inputs, no template)."""
        caps = self.manifest.logprobs
        if not caps.explicit_token_ids or caps.max_top_logprobs <= 0:
            raise RequestError(
                "this model core has no explicit-ID logprob inputs, which decisions need; re-export it", param="model"
            )
        if self.template is None:
            raise RequestError("this model core has no chat template, which decisions need", param="model")

    def max_options(self) -> int:
        return min(len(LABEL_ALPHABET), self.manifest.logprobs.max_explicit_token_ids)

    def compile(self, state: str, question: Question, response_id: str, index: int) -> CompiledQuestion:
        """The engine request of one question, its labels verified against the rendered prompt."""
        if len(question.options) > self.max_options():
            raise RequestError(
                f"a question may have at most {self.max_options()} options with this model core's labels",
                param="questions",
            )
        labels = LABEL_ALPHABET[: len(question.options)]
        conversation = Conversation(
            [
                Message(
                    "user",
                    split_assets(
                        f"Read the following state; questions about it follow.\n\nState:\n{state}", self.assets
                    ),
                ),
                Message("user", split_assets(question_text(question, labels), self.assets)),
            ]
        )
        kwargs = {"enable_thinking": False}
        lowered = lower(
            conversation,
            ChatOptions(template_kwargs=kwargs),
            manifest=self.manifest,
            template=self.template,
            tokenizer=self.tokenizer,
        )
        if lowered.reasoning is not None and lowered.reasoning.starts_open:
            raise RequestError(
                "this model core's template always starts in reasoning, so an answer label "
                "cannot be the first generated token",
                param="model",
            )
        # Labels follow the rendered text, where each image is still its one placeholder token.
        text_ids = self.tokenizer.encode(lowered.prompt_text, add_bos=False) if lowered.images else lowered.prompt_ids
        label_ids = self._verify_labels(lowered.prompt_text, text_ids, labels)
        limit = self.manifest.limits.context_length
        if len(lowered.prompt_ids) + 1 > limit:
            raise RequestError(
                f"a question's prompt has {len(lowered.prompt_ids)} tokens, over this model's {limit}-token context",
                param="questions",
            )
        sampling = SamplingParams(
            temperature=max(self.manifest.sampling.defaults.temperature, 1e-5),
            max_tokens=1,
            ignore_eos=True,  # the read token must carry its entry even when it is an EOS
            logprobs=0,
            logprob_token_ids=label_ids,
            seed=0,
        )
        [request] = engine_requests(
            response_id,
            lowered.prompt_ids,
            sampling,
            first_index=index,
            checkpoints=lowered.checkpoints,
            images=lowered.images,
        )
        return CompiledQuestion(request, label_ids)

    def _verify_labels(self, prompt_text: str, prompt_ids: list[int], labels: list[str]) -> list[int]:
        ids = []
        for label in labels:
            encoded = self.tokenizer.encode(prompt_text + label, add_bos=False)
            if encoded[: len(prompt_ids)] != prompt_ids or len(encoded) != len(prompt_ids) + 1:
                raise RequestError(
                    f"the label {label!r} is not one token after this model core's rendered prompt, "
                    "so decisions cannot read it",
                    param="questions",
                )
            ids.append(encoded[-1])
        if len(set(ids)) != len(ids):
            raise RequestError("the answer labels are not distinct tokens for this model core", param="questions")
        return ids


def question_text(question: Question, labels: list[str]) -> str:
    lines = [question.instructions.strip(), "", "Options:"]
    for label, option in zip(labels, question.options):
        line = f"{label}. {option.text}"
        if option.description:
            line += f" ({option.description})"
        lines.append(line)
    lines += ["", "Reply with the letter of exactly one option.", "Answer:"]
    return "\n".join(lines)


def as_text(value: Any) -> str:
    """A string as is; structured JSON (objects, arrays, numbers, booleans) as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def label_logprobs(entry_top: list[tuple[int, float]], label_ids: list[int]) -> list[float]:
    """The labels' logprobs from an explicit-ID entry (caller order, sampled id maybe appended)."""
    found = {token_id: lp for token_id, lp in entry_top}
    return [found[i] for i in label_ids]


# -- answer math ---------------------------------------------------------------------------------


def winner(probabilities: list[float]) -> int:
    """The most probable option, the first one on ties."""
    best = 0
    for i, p in enumerate(probabilities):
        if p > probabilities[best]:
            best = i
    return best


def choice_confidence(probabilities: list[float]) -> float:
    """System One's choice confidence: the winner's margin over the runner-up (1 for one option)."""
    if len(probabilities) == 1:
        return 1.0
    ranked = sorted(probabilities, reverse=True)
    return ranked[0] - ranked[1]


def expected_score(probabilities: list[float]) -> float:
    """The probability-weighted zero-based level."""
    return sum(i * p for i, p in enumerate(probabilities))


def score_confidence(probabilities: list[float]) -> float:
    """System One's score confidence: 1 - spread, the standard deviation of the level
    distribution over its largest possible value ((n - 1) / 2); 1 for one level."""
    n = len(probabilities)
    if n == 1:
        return 1.0
    mean = expected_score(probabilities)
    spread = math.sqrt(sum(p * (i - mean) ** 2 for i, p in enumerate(probabilities)))
    return max(0.0, 1.0 - spread / ((n - 1) / 2))
