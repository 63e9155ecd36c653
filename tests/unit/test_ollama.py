"""GET /api/tags and POST /api/show (Ollama discovery) on a live tiny server, plus the digest's
dependence on the advertised metadata."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from types import SimpleNamespace

import httpx
import pytest

from helios.manifest import Manifest
from helios.protocols import ollama


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def manifest(tiny_core) -> Manifest:
    return Manifest.load(tiny_core, verify_files=False)


def test_version_satisfies_ollama_aware_clients(http: httpx.Client):
    """Codex 0.162.1 (`--oss --local-provider ollama`) refuses a server that reports a version
    older than 0.13.4; other tools probe the route to detect a server."""
    answer = http.get("/api/version")
    assert answer.status_code == 200
    version = answer.json()["version"]
    assert tuple(int(part) for part in version.split(".")) >= (0, 13, 4)


def test_tags_lists_the_loaded_model(http: httpx.Client, manifest: Manifest):
    card = http.get("/v1/models").json()["data"][0]
    listed = http.get("/api/tags")
    assert listed.status_code == 200
    [model] = listed.json()["models"]
    assert model["name"] == model["model"] == card["id"] == manifest.model_id
    assert model["size"] == 0 and model["modified_at"] == "0001-01-01T00:00:00Z"
    assert re.fullmatch(r"[0-9a-f]{64}", model["digest"])  # sha256 hex, as Ollama lists
    details = model["details"]
    assert details["format"] == "flare" and details["families"] == [] and details["parent_model"] == ""
    assert details["family"] == manifest.architecture.family and details["parameter_size"] == ""
    assert http.get("/api/tags").json() == listed.json()  # stable


def test_show_reports_contract_metadata(http: httpx.Client, manifest: Manifest):
    card = http.get("/v1/models").json()["data"][0]
    shown = http.post("/api/show", json={"model": card["id"]})
    assert shown.status_code == 200
    info = shown.json()
    assert info["details"] == http.get("/api/tags").json()["models"][0]["details"]
    assert info["model_info"]["general.name"] == card["id"]
    assert info["model_info"]["flare.context_length"] == card["max_model_len"] == manifest.limits.context_length
    assert info["model_info"]["flare.vocab_size"] == card["flare"]["vocab_size"]
    assert info["capabilities"][0] == "completion"
    assert ("tools" in info["capabilities"]) == bool(manifest.parsers.tool)
    assert ("thinking" in info["capabilities"]) == bool(manifest.parsers.reasoning)
    assert "vision" not in info["capabilities"]  # text-only core
    assert "template" not in info and "tensors" not in info
    names = {card["root"], manifest.identity.checkpoint_id, *[a for a in manifest.identity.aliases if a]}
    for name in names:
        for verbose in (None, False, True):
            body = {"model": name} if verbose is None else {"model": name, "verbose": verbose}
            assert http.post("/api/show", json=body).json() == info


@pytest.mark.parametrize(
    "body,status",
    [
        ({}, 400),
        ({"model": ""}, 400),
        ({"model": 7}, 400),
        ({"model": None}, 400),
        ({"model": "qwen2.5-coder", "verbose": "yes"}, 400),
        ({"model": "__missing__"}, 404),
    ],
)
def test_show_errors_use_the_ollama_shape(http: httpx.Client, body, status):
    response = http.post("/api/show", json=body)
    assert response.status_code == status
    assert set(response.json()) == {"error"} and isinstance(response.json()["error"], str)


def test_show_body_rules(http: httpx.Client, manifest: Manifest):
    raw = json.dumps({"model": manifest.model_id}).encode()
    for content, headers, status in [
        (b"{", {}, 400),
        (b"[1]", {}, 400),
        (gzip.compress(raw), {"Content-Encoding": "gzip"}, 415),
        (raw, {"Content-Encoding": "compress"}, 415),
        (raw, {"Content-Encoding": "identity"}, 200),
    ]:
        response = http.post("/api/show", content=content, headers=headers)
        assert response.status_code == status, (content, headers, response.text)
        if status != 200:
            assert isinstance(response.json()["error"], str)
    generation = http.post("/api/chat", json={"model": manifest.model_id})
    assert generation.status_code == 404 and isinstance(generation.json()["error"], str)


def test_digest_follows_advertised_metadata(manifest: Manifest):
    def ctx(m: Manifest) -> SimpleNamespace:
        return SimpleNamespace(manifest=m, model_id=m.model_id)

    base = ollama.digest(ctx(manifest))
    assert base == ollama.digest(ctx(manifest))
    renamed = dataclasses.replace(manifest, identity=dataclasses.replace(manifest.identity, aliases=["other"]))
    longer = dataclasses.replace(manifest, limits=dataclasses.replace(manifest.limits, context_length=123))
    untooled = dataclasses.replace(manifest, parsers=dataclasses.replace(manifest.parsers, tool=None))
    digests = {base, *(ollama.digest(ctx(m)) for m in (renamed, longer, untooled))}
    assert len(digests) == 4
    assert "tools" not in ollama.capabilities(ctx(untooled))
