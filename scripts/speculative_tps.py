"""Speculative decoding speed through the real HTTP API (prints numbers, asserts nothing).

    python scripts/speculative_tps.py [--core cores/default] [--json OUT]
    python scripts/bench.py --speculative ...     # the same section inside bench.py's JSON

Workloads, each on a `helios serve CORE --speculation off` and then an `--speculation auto`
server (same process settings otherwise), greedy, streamed:
- edit: a completion whose prompt shows a ~150-line Python module and starts its copy with one
  identifier renamed (what coding agents do most: re-emit code they were just shown);
- free: an open-ended writing request (nothing to copy);
- code: new code from a short chat prompt (nothing to copy; reported, no target);
- b8: eight concurrent free-writing streams (best of two runs).
Decode tokens/s = (tokens after the first) / (time after the first token); b8 is the aggregate.
The edit outputs of both servers are compared (greedy: they must be the same text).
A core with a learned drafter (ignition export --drafter) also runs history drafts alone and the
drafter alone (`history_only`, `learned_only`, the latter allowed to read the whole edit prompt):
what each source buys.
Peer: llama.cpp (llama-cpp-python on the GGUF the core came from, same threads) on the same edit
prompt, plainly and with its prompt-lookup speculation (scripts/peers/llamacpp_run.py --edit),
and for a core with a drafter, with the drafter's GGUF as its draft model;
`peer_edit_best_tps` is the best of them.
Targets: edit on >= 2.5x off and >= 2x the peer's best mode; free on >= 0.95x off; b8 on >=
0.95x off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from helios.launcher import HeliosProcess

TARGETS = {"edit": 2.5, "free": 0.95, "b8": 0.95}


def source_module(functions: int = 14) -> str:
    """A plausible ~150-line module: a class with methods that use `record_store` often."""
    lines = [
        '"""Inventory bookkeeping for the warehouse service."""',
        "",
        "import json",
        "from pathlib import Path",
        "",
        "",
        "class Inventory:",
        "    def __init__(self, path: Path):",
        "        self.path = path",
        "        self.record_store = {}",
        "",
    ]
    for i in range(functions):
        lines += [
            f"    def update_item_{i}(self, sku: str, count: int) -> int:",
            f'        """Adjust the stock of item group {i} and return the new count."""',
            "        current = self.record_store.get(sku, 0)",
            f"        current += count * {i + 1}",
            "        if current < 0:",
            f'            raise ValueError(f"stock of {{sku}} would drop below zero in group {i}")',
            "        self.record_store[sku] = current",
            "        return current",
            "",
        ]
    lines += [
        "    def save(self) -> None:",
        "        self.path.write_text(json.dumps(self.record_store, indent=2))",
        "",
    ]
    return "\n".join(lines)


def edit_prompt() -> str:
    """The file, then the start of its edited copy (a completion, as an editor integration sends
    it: the 0.5B model asked in chat rewrites the file into something else)."""
    return (
        "# inventory.py\n```python\n" + source_module() + "\n```\n\n"
        "# inventory.py after renaming the attribute `record_store` to `stock_levels` everywhere\n```python\n"
    )


FREE = [{"role": "user", "content": "Write an original short story about a lighthouse keeper who finds a map."}]
# New code from a short prompt: nothing to copy, but a small model of the family often guesses
# the next token (where a learned drafter can pay; no target, reported).
CODE = [
    {
        "role": "user",
        "content": "Write a Python function that merges overlapping intervals in a list of "
        "(start, end) tuples, with a docstring and a few doctest examples.",
    }
]


def stream(client: httpx.Client, prompt: list[dict] | str, max_tokens: int) -> tuple[str, int, float]:
    """(text, tokens, seconds after the first token) of one greedy streamed chat (messages) or
    completion (a string)."""
    chat = not isinstance(prompt, str)
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "top_k": 1,  # greedy: temperature 0 alone is clamped to the core's minimum and still samples
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"messages": prompt} if chat else {"prompt": prompt, "stop": ["```"]}),
    }
    text, first, tokens = [], None, 0
    with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text.append(piece)
    return "".join(text), tokens, time.perf_counter() - (first or time.perf_counter())


def streams8(client: httpx.Client) -> float:
    """Aggregate tok/s of eight concurrent free-writing streams."""
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: stream(client, FREE, 96), range(8)))
    return sum(t for _, t, _ in results) / (time.perf_counter() - started)


def rates(core: Path, mode: str, log: Callable[[str], None], settings: str = "", label: str = "") -> dict:
    """One server's figures; `settings`: extra [server] TOML lines (which draft sources run)."""
    args = ["--speculation", mode]
    if settings:
        config = Path(tempfile.mkdtemp()) / "helios.toml"
        config.write_text("[server]\n" + settings)
        args += ["--config", str(config)]
    server = HeliosProcess(core, *args)
    try:
        with httpx.Client(base_url=server.url, timeout=1800) as client:
            stream(client, [{"role": "user", "content": "warm up"}], 8)
            text, tokens, seconds = stream(client, edit_prompt(), 1200)
            edit = (tokens - 1) / seconds
            _, tokens, seconds = stream(client, FREE, 200)
            free = (tokens - 1) / seconds
            _, tokens, seconds = stream(client, CODE, 200)
            code = (tokens - 1) / seconds
            b8 = max(streams8(client) for _ in range(2))  # best of two: other tenants' load moves it
            metrics = client.get("/metrics", params={"format": "json"}).json()
    finally:
        server.stop()
    accepted, offered = metrics.get("accepted_drafts", 0), metrics.get("verification_drafts", 0)
    log(
        f"{label or mode:8s} edit {edit:7.1f} tok/s  free {free:7.1f}  code {code:7.1f}  b8 {b8:7.1f}  drafts {offered} "
        f"accepted {accepted} drafter steps {metrics.get('draft_steps', 0)}"
    )
    return {
        "edit_tps": round(edit, 2),
        "free_tps": round(free, 2),
        "code_tps": round(code, 2),
        "b8_tps": round(b8, 2),
        "edit_text": text,
        "accepted": accepted,
        "offered": offered,
        "rounds": metrics.get("verification_rounds", 0),
        "draft_steps": metrics.get("draft_steps", 0),
    }


def peer_edit(core: Path, log: Callable[[str], None]) -> dict:
    """llama.cpp on the same edit prompt, plain and with prompt-lookup drafts ({"error"} when it
    cannot run: no packaged GGUF for this core, or its venv fails to build)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from peers import envs as setup

        from helios.manifest import Manifest
        from ignition.checkpoints.packaged import PACKAGED_MODELS, resolve_packaged

        manifest = Manifest.load(core, verify_files=False)
        name = manifest.identity.checkpoint_id
        if name not in PACKAGED_MODELS:
            return {"error": f"no packaged GGUF for {name!r}"}
        gguf = resolve_packaged(PACKAGED_MODELS[name], report=setup.log)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
            handle.write(edit_prompt())
        extra = []
        if manifest.drafter is not None and manifest.drafter.checkpoint_id in PACKAGED_MODELS:
            # The same pair: llama.cpp drafting with the core's drafter model.
            extra = [
                "--draft",
                str(resolve_packaged(PACKAGED_MODELS[manifest.drafter.checkpoint_id], report=setup.log)),
            ]
        result = setup.run_peer(
            setup.ensure_llamacpp(),
            "llamacpp_run.py",
            [str(gguf), "--threads", str(os.cpu_count() or 1), "--edit", handle.name, "--decode", "1200", *extra],
            timeout=3600,
        )
    except Exception as exc:  # a peer failing must not lose helios's numbers
        return {"error": str(exc)[-500:]}
    log(
        f"llama.cpp edit {result['edit_plain_tps']:7.1f} tok/s plain, {result['edit_lookup_tps']:7.1f} prompt-lookup"
        + (f", {result['edit_draft_tps']:7.1f} draft model" if "edit_draft_tps" in result else "")
    )
    return result


def measure(core: Path, log: Callable[[str], None] = print, peers: bool = True) -> dict:
    """bench.py's `speculative` section for one core."""
    off = rates(core, "off", log)
    on = rates(core, "auto", log)
    parts = {}
    if _has_drafter(core):  # what each draft source buys alone
        parts["history_only"] = rates(core, "auto", log, "speculation_learned_drafter = false\n", "history")
        # The drafter alone, allowed to read the whole edit prompt (the default catch-up bound
        # keeps it off prompts this long).
        parts["learned_only"] = rates(
            core,
            "auto",
            log,
            "speculation_history_drafts = false\nspeculation_drafter_catch_up_tokens = 4096\n",
            "learned",
        )
    result = {
        "edit_on_tps": on["edit_tps"],
        "edit_off_tps": off["edit_tps"],
        "free_on_tps": on["free_tps"],
        "free_off_tps": off["free_tps"],
        "b8_on_tps": on["b8_tps"],
        "b8_off_tps": off["b8_tps"],
        "code_on_tps": on["code_tps"],
        "code_off_tps": off["code_tps"],
        "acceptance": round(on["accepted"] / on["offered"], 3) if on["offered"] else None,
        "edit_identical": on["edit_text"] == off["edit_text"],
        "draft_steps": on["draft_steps"],
    }
    for name, part in parts.items():
        result[name] = {
            key: part[key]
            for key in ("edit_tps", "free_tps", "code_tps", "b8_tps", "accepted", "offered", "draft_steps")
        }
        result[name]["edit_identical"] = part["edit_text"] == off["edit_text"]
    result["ratios"] = {
        name: round(result[f"{name}_on_tps"] / result[f"{name}_off_tps"], 3) for name in (*TARGETS, "code")
    }
    result["targets"] = {
        name: {"target": f">= {bound}x off", "met": result["ratios"][name] >= bound} for name, bound in TARGETS.items()
    }
    if peers:
        peer = peer_edit(core, log)
        result["peer"] = peer
        if "error" not in peer:
            best = max(peer[key] for key in ("edit_plain_tps", "edit_lookup_tps", "edit_draft_tps") if key in peer)
            result["peer_edit_best_tps"] = best
            result["ratios"]["edit_vs_peer"] = round(result["edit_on_tps"] / best, 3)
            result["targets"]["edit_vs_peer"] = {
                "target": ">= 2x the peer's best mode",
                "met": result["ratios"]["edit_vs_peer"] >= 2,
            }
    return result


def _has_drafter(core: Path) -> bool:
    from helios.manifest import Manifest

    return Manifest.load(core, verify_files=False).drafter is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=Path, default=Path("cores/default"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-peers", action="store_true", help="helios only")
    args = parser.parse_args()
    result = {args.core.name: measure(args.core, log=lambda line: print(line, flush=True), peers=not args.no_peers)}
    print(json.dumps({"speculative": result}, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"speculative": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
