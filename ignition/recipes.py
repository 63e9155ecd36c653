"""Recipes: `recipes/NAME.toml` files that say how a checkpoint becomes a core.

A recipe is data: architecture family, default checkpoint, sampling defaults and inclusive
ranges, stop tokens, parser syntax, template source and serving limits. It is validated here,
before any expensive work starts.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from helios.manifest import TEMPLATE_REJECTS, Range, SamplingDefaults
from helios.neutral.parsers import REASONING_SYNTAXES, TOOL_SYNTAXES
from helios.neutral.thinking import EFFORT_LEVELS, template_levels

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
RECIPE_PRECISIONS = ("int4", "int8", "fp32")  # ignition.export.quantize.PRECISIONS, without importing onnx
# Families the exporter compiles (qwen2/llama: common.DecoderLM; the rest: models/configured.py)
# and families recipes may already name whose architecture it refuses with what is missing
# (ignition.models.PLANNED; docs/recipes.md).
COMPILED_FAMILIES = (
    "qwen2",
    "llama",
    "deepseek_v3",
    "mimo_v2_flash",
    "gemma4",
    "step3p7",
    "muse_spark",
    "glm_moe_dsa",
    "minimax_m3_vl",
    "qwen3_5_moe",
    "qwen3_5",
    "deepseek_v4",
    "nemotron_h",
    "qwen3",
    "mistral",
    "gemma3",
    "gemma2",
    "smollm3",
    "phi3",
)
PLANNED_FAMILIES: tuple[str, ...] = ()
KNOWN_FAMILIES = COMPILED_FAMILIES + PLANNED_FAMILIES
# Template behaviours a recipe can declare its (native) prompt encoder refuses (api.md: the
# DeepSeek encoders reject drop_thinking, assistant continuation and add_generation_prompt=false).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingDefaults) if f.name != "seed")


class RecipeError(ValueError):
    pass


@dataclass
class RecipeLimits:
    max_concurrency: int
    prefill_chunk_size: int
    max_batch_tokens: int
    default_max_tokens: int
    page_tokens: int
    # None: the checkpoint's native context. A recipe narrows it only with a comment saying why.
    context_length: int | None = None
    # The least default KV pool; export raises it to hold two full-context sequences.
    kv_pages: int = 0


@dataclass
class RecipeReasoning:
    """The family's reasoning syntax as the recipe declares it (checked against the parser's)."""

    open: str  # the opening delimiter ("<think>", Gemma 4's "<|channel>thought")
    close: str
    starts_in_reasoning: bool  # the generation prompt opens reasoning (thinking on by default)
    always: bool = False  # thinking cannot be switched off (Kimi K3: enable_thinking=false is ignored)
    effort_levels: list[str] = field(default_factory=list)  # the template's reasoning_effort vocabulary
    default_effort: str | None = None
    numeric_effort: tuple[int, int] | None = None  # integer reasoning_effort scores (DeepSeek V4.1: 1..100)


@dataclass
class Recipe:
    name: str
    family: str
    default_checkpoint: str
    aliases: list[str]
    description: str
    template_source: str  # "checkpoint" or a path relative to the recipes folder
    supports_system: bool
    supports_tools: bool
    eos_tokens: list[str]
    add_bos: bool | None  # None: take the checkpoint's own setting
    tool_parser: str | None
    reasoning_parser: str | None
    sampling_defaults: SamplingDefaults
    sampling_ranges: dict[str, Range]
    limits: RecipeLimits
    path: Path = field(default=Path())
    reasoning: RecipeReasoning | None = None
    # A template file (relative to the recipes folder) used when the checkpoint has none (tiny
    # test checkpoints); a checkpoint's own template always wins with source = "checkpoint".
    template_fallback: str | None = None
    template_rejects: list[str] = field(default_factory=list)  # TEMPLATE_REJECTS the encoder refuses
    # Hugging Face repository ids (ORG/NAME) of the checkpoint, looked up in the local HF cache
    # when there is no packaged default and no --checkpoint (checkpoints/hub_cache.py).
    hub_ids: list[str] = field(default_factory=list)
    # The weight precision a checkpoint compiles to unless --precision says otherwise: int4, or
    # int8 for a model that int4 measurably breaks (docs/recipes.md).
    precision: str = "int4"


def available_recipes(folder: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.toml"))


def load_recipe(name: str, folder: Path = RECIPES_DIR) -> Recipe:
    path = Path(name) if name.endswith(".toml") else folder / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(available_recipes(folder)) or "none"
        raise RecipeError(f"unknown recipe {name!r} (available: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: invalid TOML: {exc}") from None
    try:
        recipe = _parse(data, path)
    except (KeyError, TypeError) as exc:
        raise RecipeError(f"{path}: missing or malformed field {exc}") from None
    _check(recipe)
    return recipe


def _parse(data: dict, path: Path) -> Recipe:
    head, template, tokens = data["recipe"], data.get("template", {}), data.get("tokens", {})
    parsers, sampling = data.get("parsers", {}), data.get("sampling", {})
    defaults = sampling.get("defaults", {})
    unknown = set(defaults) - set(SAMPLING_FIELDS)
    if unknown:
        raise RecipeError(f"{path}: unknown sampling defaults {sorted(unknown)}")
    ranges = {}
    for key, bounds in sampling.get("ranges", {}).items():
        if key not in SAMPLING_FIELDS:
            raise RecipeError(f"{path}: unknown sampling range {key!r}")
        if not (isinstance(bounds, list) and len(bounds) == 2):
            raise RecipeError(f"{path}: sampling range {key} must be [min, max]")
        ranges[key] = Range(min=float(bounds[0]), max=float(bounds[1]))
    return Recipe(
        name=head["name"],
        family=head["family"],
        default_checkpoint=head["default_checkpoint"],
        aliases=list(head.get("aliases", [])),
        description=head.get("description", ""),
        template_source=template.get("source", "checkpoint"),
        supports_system=bool(template.get("supports_system", True)),
        supports_tools=bool(template.get("supports_tools", False)),
        eos_tokens=list(tokens.get("eos", [])),
        add_bos=tokens.get("add_bos"),
        tool_parser=parsers.get("tool") or None,
        reasoning_parser=parsers.get("reasoning") or None,
        sampling_defaults=SamplingDefaults(**defaults),
        sampling_ranges=ranges,
        limits=RecipeLimits(**data["limits"]),
        path=path,
        reasoning=_reasoning(data.get("reasoning")),
        template_fallback=template.get("fallback"),
        template_rejects=list(template.get("rejects", [])),
        hub_ids=list(head.get("hub_ids", [])),
        precision=str(head.get("precision", "int4")),
    )


def _reasoning(table: dict | None) -> RecipeReasoning | None:
    if not table:
        return None
    numeric = table.get("numeric_effort")
    if numeric is not None and not (
        isinstance(numeric, list) and len(numeric) == 2 and all(isinstance(v, int) for v in numeric)
    ):
        raise TypeError("reasoning.numeric_effort must be [min, max] integers")
    return RecipeReasoning(
        open=table["open"],
        close=table["close"],
        starts_in_reasoning=bool(table["starts_in_reasoning"]),
        always=bool(table.get("always", False)),
        effort_levels=list(table.get("effort_levels", [])),
        default_effort=table.get("default_effort"),
        numeric_effort=tuple(numeric) if numeric else None,
    )


def _check(recipe: Recipe) -> None:
    where = recipe.path
    if recipe.family not in KNOWN_FAMILIES:
        raise RecipeError(f"{where}: family {recipe.family!r} is not supported (known: {', '.join(KNOWN_FAMILIES)})")
    if recipe.precision not in RECIPE_PRECISIONS:
        raise RecipeError(f"{where}: precision {recipe.precision!r} is not one of {', '.join(RECIPE_PRECISIONS)}")
    d = recipe.sampling_defaults
    if d.temperature <= 0:
        raise RecipeError(f"{where}: default temperature must be positive")
    if not isinstance(d.top_k, int):
        raise RecipeError(f"{where}: top_k must be an integer")
    for key, bounds in recipe.sampling_ranges.items():
        value = getattr(d, key)
        if bounds.min > bounds.max:
            raise RecipeError(f"{where}: range {key} has min > max")
        if not bounds.min <= value <= bounds.max:
            raise RecipeError(f"{where}: default {key}={value} lies outside its range [{bounds.min}, {bounds.max}]")
    if "temperature" in recipe.sampling_ranges and recipe.sampling_ranges["temperature"].min <= 0:
        raise RecipeError(f"{where}: temperature bounds must be positive")
    if (
        "top_p" in recipe.sampling_ranges
        and not 0 < recipe.sampling_ranges["top_p"].min <= recipe.sampling_ranges["top_p"].max <= 1
    ):
        raise RecipeError(f"{where}: top_p bounds must lie in (0, 1]")
    bad_ids = [i for i in recipe.hub_ids if not HUB_ID.fullmatch(str(i))]
    if bad_ids:
        raise RecipeError(f"{where}: hub_ids must be Hugging Face repository ids ORG/NAME, not {bad_ids}")
    _check_syntax(recipe)
    lim = recipe.limits
    if min(lim.max_concurrency, lim.prefill_chunk_size, lim.page_tokens) <= 0 or lim.kv_pages < 0:
        raise RecipeError(f"{where}: limits must be positive")
    if lim.context_length is not None and lim.context_length <= 0:
        raise RecipeError(
            f"{where}: limits.context_length must be positive (omit it for the checkpoint's native context)"
        )
    if lim.max_batch_tokens < lim.prefill_chunk_size:
        raise RecipeError(f"{where}: max_batch_tokens must be at least prefill_chunk_size")


def _check_syntax(recipe: Recipe) -> None:
    """Parsers, reasoning delimiters, effort vocabulary and template rules agree with helios."""
    where = recipe.path
    if recipe.tool_parser and recipe.tool_parser not in TOOL_SYNTAXES:
        raise RecipeError(f"{where}: unknown tool syntax {recipe.tool_parser!r}")
    if recipe.reasoning_parser and recipe.reasoning_parser not in REASONING_SYNTAXES:
        raise RecipeError(f"{where}: unknown reasoning syntax {recipe.reasoning_parser!r}")
    bad = [r for r in recipe.template_rejects if r not in TEMPLATE_REJECTS]
    if bad:
        raise RecipeError(f"{where}: unknown template rejects {bad} (known: {', '.join(TEMPLATE_REJECTS)})")
    r = recipe.reasoning
    if r is None:  # the [reasoning] table is optional: the parser alone names the syntax
        return
    syntax = REASONING_SYNTAXES.get(recipe.reasoning_parser or "")
    if syntax is None:
        raise RecipeError(f"{where}: [reasoning] needs parsers.reasoning")
    if (r.open, r.close) != (syntax.open, syntax.close):
        raise RecipeError(
            f"{where}: reasoning delimiters {r.open!r}/{r.close!r} differ from the {syntax.name} parser's "
            f"{syntax.open!r}/{syntax.close!r}"
        )
    unknown = [level for level in r.effort_levels if level not in EFFORT_LEVELS[1:]]
    if unknown:
        raise RecipeError(f"{where}: unknown effort levels {unknown} (known: {', '.join(EFFORT_LEVELS[1:])})")
    if r.default_effort is not None and r.default_effort not in r.effort_levels:
        raise RecipeError(f"{where}: default effort {r.default_effort!r} is not one of {r.effort_levels}")
    if r.numeric_effort is not None and not 1 <= r.numeric_effort[0] <= r.numeric_effort[1] <= 100:
        raise RecipeError(f"{where}: numeric effort bounds must lie in 1..100")
    if recipe.template_fallback:
        path = recipe.path.parent / recipe.template_fallback
        if not path.is_file():
            raise RecipeError(f"{where}: template fallback {recipe.template_fallback} does not exist")
        # helios reads the effort vocabulary from the template text (frontend/thinking.py).
        named = template_levels(path.read_text())
        if r.effort_levels and sorted(named) != sorted(r.effort_levels):
            raise RecipeError(
                f"{where}: {recipe.template_fallback} names effort levels {named}, the recipe {r.effort_levels}"
            )
