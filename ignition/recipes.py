"""Recipes: `recipes/NAME.toml` files that say how a checkpoint becomes a core.

A recipe is data: architecture family, default checkpoint, sampling defaults and inclusive
ranges, stop tokens, parser syntax, template source and serving limits. It is validated here,
before any expensive work starts.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from helios.manifest import Range, SamplingDefaults

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
KNOWN_FAMILIES = ("qwen2", "llama")
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingDefaults) if f.name != "seed")


class RecipeError(ValueError):
    pass


@dataclass
class RecipeLimits:
    context_length: int
    max_concurrency: int
    prefill_chunk_size: int
    max_batch_tokens: int
    default_max_tokens: int
    kv_pages: int
    page_tokens: int


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
    )


def _check(recipe: Recipe) -> None:
    where = recipe.path
    if recipe.family not in KNOWN_FAMILIES:
        raise RecipeError(f"{where}: family {recipe.family!r} is not supported (known: {', '.join(KNOWN_FAMILIES)})")
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
    if "top_p" in recipe.sampling_ranges and not 0 < recipe.sampling_ranges["top_p"].min <= recipe.sampling_ranges["top_p"].max <= 1:
        raise RecipeError(f"{where}: top_p bounds must lie in (0, 1]")
    lim = recipe.limits
    if min(lim.context_length, lim.max_concurrency, lim.prefill_chunk_size, lim.page_tokens, lim.kv_pages) <= 0:
        raise RecipeError(f"{where}: limits must be positive")
    if lim.max_batch_tokens < lim.prefill_chunk_size:
        raise RecipeError(f"{where}: max_batch_tokens must be at least prefill_chunk_size")
