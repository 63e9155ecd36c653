"""What a checkpoint's own chat template says about serving it, for a recipe that was inferred
(`helios serve CHECKPOINT` without --recipe): which of its family's recipes speaks the template's
end-of-turn tokens, and the tool and reasoning syntax the template writes.

- Recipe choice: among the family's recipes, the one whose stop tokens the template writes
  (a Llama 3 template ends turns in <|eot_id|>, SmolLM2's ChatML in <|im_end|>).
- Tools: a recipe without a tool syntax takes hermes where the template wraps calls in
  <tool_call>; a template that never renders `tools` cannot present them, so tools are refused.
- Reasoning: a recipe without a reasoning syntax takes <think>...</think> where the template
  writes both tags.
"""

from __future__ import annotations

import dataclasses
import re

from ignition.checkpoints.base import CheckpointError
from ignition.checkpoints.gguf import read_gguf_string
from ignition.checkpoints.safetensors_dir import folder_chat_template
from ignition.recipes import Recipe

HERMES_OPEN = "<tool_call>"
THINK = ("<think>", "</think>")
# The template reads the request's tools (`tools`, `tools is defined`, `tools | length`...).
USES_TOOLS = re.compile(r"\btools\b")


def checkpoint_template(kind: str, path) -> str | None:
    """The chat template a GGUF file or Hugging Face folder carries (None: it has none)."""
    try:
        if kind == "gguf":
            return read_gguf_string(path, "tokenizer.chat_template")
        if kind == "folder":
            return folder_chat_template(path)
    except (CheckpointError, OSError, ValueError):
        return None
    return None


def best_for_template(recipes: list[Recipe], template: str | None) -> Recipe:
    """The recipe whose stop tokens the template writes most of (by name on a tie)."""
    ordered = sorted(recipes, key=lambda r: r.name)
    if not template:
        return ordered[0]
    return max(ordered, key=lambda r: sum(token in template for token in r.eos_tokens))


def with_template_syntax(recipe: Recipe, template: str | None) -> Recipe:
    """The recipe's tool and reasoning syntax as the checkpoint's own template declares them."""
    if not template or recipe.template_source != "checkpoint":
        return recipe
    changes: dict[str, object] = {}
    if not USES_TOOLS.search(template):
        changes.update(supports_tools=False, tool_parser=None)
    elif recipe.tool_parser is None and HERMES_OPEN in template:
        changes.update(supports_tools=True, tool_parser="hermes")
    if recipe.reasoning_parser is None and all(tag in template for tag in THINK):
        changes.update(reasoning_parser="think")
    return dataclasses.replace(recipe, **changes) if changes else recipe
