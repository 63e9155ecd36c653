"""The house rules a reviewer can check with plain tools (docs/architecture.md, "Layers"):
imports only run down the layers, no two modules import each other (however indirectly, type-only
imports included), no source file outgrows one reading, and shared model code names no family (a
family lives in its own module under ignition/models)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ignition.models import FAMILIES, MODEL_TYPES

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600

# Lower layers first; a module may import its own layer and any layer before it.
HELIOS_LAYERS = [
    ("helios.manifest", "helios.cache_dir", "helios.kernels", "helios.version"),
    ("helios.engine",),
    ("helios.neutral",),
    ("helios.transport",),  # HTTP transport: below the protocols, never importing them
    ("helios.protocols",),
    ("helios.app", "helios.web"),  # web: the page's static files, served by the app
    ("helios.cluster",),  # scale-out: the app's frontend over engine replicas on Ray Serve
    ("helios.cli", "helios.dashboard", "helios.client_config", "helios.launcher", "helios.chat", "helios.__main__"),
]
IGNITION_LAYERS = [
    ("ignition.models",),  # torch modules over helios.manifest's Architecture
    ("ignition.recipes", "ignition.checkpoints"),  # readers check families against the registry
    ("ignition.export", "ignition.tiny", "ignition.tiny_text"),  # tiny*: write checkpoints the exporter compiles
    ("ignition.template_syntax",),  # what a checkpoint's own template says about an inferred recipe
    # intake: `helios serve MODEL`'s front half (find, infer the recipe, compile into the cache)
    ("ignition.inspect_core", "ignition.verify_core", "ignition.intake", "ignition.cli", "ignition.__main__"),
]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str, layers: list[tuple[str, ...]]) -> int | None:
    if "." not in module:
        return 0  # the package itself (its version)
    for rank, names in enumerate(layers):
        if any(module == n or module.startswith(n + ".") for n in names):
            return rank
    return None


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports at module level (type-only imports included: a
    circle drawn under TYPE_CHECKING is still two modules that need each other)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        nested = [node] if not isinstance(node, ast.If | ast.Try) else list(ast.walk(node))
        for statement in nested:
            names = []
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                names = [f"{statement.module}.{alias.name}" for alias in statement.names] + [statement.module]
            for name in names:
                if name in modules:
                    found.add(name)
                    break  # `from a.b import c`: the module c if it is one, else a.b
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                groups.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package,layers", [("helios", HELIOS_LAYERS), ("ignition", IGNITION_LAYERS)])
def test_imports_run_down_the_layers(package: str, layers: list[tuple[str, ...]]):
    upward = []
    for path in _sources(package):
        own = _layer(_module(path), layers)
        assert own is not None, f"{path.relative_to(ROOT)} belongs to no layer of {package}"
        for imported in _imports(path):
            target = _layer(imported, layers)
            if target is not None and target > own:
                upward.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not upward, "imports running up the layers:\n" + "\n".join(sorted(set(upward)))


@pytest.mark.parametrize("package", ["helios", "ignition"])
def test_no_import_cycles(package: str):
    paths = {_module(path): path for path in _sources(package)}
    graph = {module: _module_imports(path, set(paths)) - {module} for module, path in paths.items()}
    cycles = _cycles(graph)
    assert not cycles, "modules importing each other:\n" + "\n".join(" <-> ".join(group) for group in cycles)


def test_no_source_file_outgrows_one_reading():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for package in ("helios", "ignition")
        for path in _sources(package)
        if "kernels" not in path.parts and (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


# Model-family brands (a family's registry name starts with one of them); shared model code names none.
BRANDS = (
    "qwen",
    "llama",
    "deepseek",
    "glm",
    "mimo",
    "gemma",
    "step3",
    "muse",
    "minimax",
    "nemotron",
    "kimi",
    "mistral",
    "ministral",
    "smollm",
    "phi3",
)
SHARED_MODEL_CODE = ("blocks", "base.py", "plans.py", "configured.py", "decoder.py", "ops.py")


def test_shared_model_code_names_no_family():
    families = set(FAMILIES) | set(MODEL_TYPES)
    assert all(name.startswith(BRANDS) for name in families), "a family brand is missing from BRANDS"
    models = ROOT / "ignition" / "models"
    shared = [
        p
        for name in SHARED_MODEL_CODE
        for p in sorted((models / name).rglob("*.py") if name == "blocks" else [models / name])
    ]
    named = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in shared
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if any(b in line.lower() for b in BRANDS)
    ]
    assert not named, "shared model code naming a family:\n" + "\n".join(named)
