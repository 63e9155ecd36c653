"""Image input over HTTP on a served tiny qwen38 vision core (`ignition tiny-checkpoint`, then the
default int4 export): every protocol's image parts, usage, count_tokens, api.md's 400s, the card
and /api/show, and prefix reuse over an image (a real server, real SDK-shaped JSON)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from helios.dashboard import Snapshot, View
from helios.launcher import HeliosProcess
from helios.manifest import Manifest
from helios.neutral.errors import RequestError
from helios.neutral.images import prepare_image
from ignition.recipes import load_recipe
from ignition.tiny import TinyError, write_tiny_checkpoint
from tests.conftest import export

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def vision_core(tmp_path_factory) -> Path:
    folder = write_tiny_checkpoint(load_recipe("qwen38"), tmp_path_factory.mktemp("tiny-qwen38"))
    return export("qwen38", str(folder), tmp_path_factory.mktemp("cores") / "tiny-vision", "int4", prompt_logprobs=True)


@pytest.fixture(scope="module")
def server(vision_core: Path) -> Iterator[HeliosProcess]:
    running = HeliosProcess(vision_core)
    yield running
    running.stop()


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG", **save) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, fmt, **save)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat_image(data: bytes, media: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{b64(data)}"}}


def message_image(data: bytes, media: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media, "data": b64(data)}}


def post(server: HeliosProcess, path: str, body: dict) -> httpx.Response:
    headers = {"anthropic-version": "2023-06-01"} if path.startswith("/v1/messages") else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def test_card_and_show_report_the_prepared_vision(server: HeliosProcess):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]["flare"]
    assert card["input_modalities"] == ["text", "image"]
    assert card["max_image_tokens_per_image"] == card["image_feature_window_tokens"] == 196
    assert card["max_images_per_prompt"] > 0 and card["max_image_tokens_per_prompt"] == 8191
    assert card["max_image_pixels"] > 0 and card["max_image_bytes"] > 0
    show = httpx.post(server.url + "/api/show", json={"model": "Qwen3.8-Flash-Next"}).json()
    assert "vision" in show["capabilities"]


def test_chat_usage_counts_image_tokens_as_messages_count_tokens_does(server: HeliosProcess):
    """A 96x64 image is a 4x6 patch grid: 6 image tokens (2x2 patches each)."""
    image = png(96, 64)
    with_param = {"type": "image_url", "image_url": {"url": f"data:image/png;name=shot.png;base64,{b64(image)}"}}
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": [with_param, {"type": "text", "text": "Describe it."}]}],
            "max_tokens": 4,
            **NO_THINKING,
        },
    )
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens_details"]["multimodal_tokens"] == {"image": 6}
    counted = post(
        server,
        "/v1/messages/count_tokens",
        {
            "model": "local",
            "messages": [{"role": "user", "content": [message_image(image), {"type": "text", "text": "Describe it."}]}],
            **NO_THINKING,
        },
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == usage["prompt_tokens"]
    text_only = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Describe it."}], "max_tokens": 1, **NO_THINKING},
    ).json()["usage"]
    assert "multimodal_tokens" not in text_only["prompt_tokens_details"]
    # The image adds its 6 tokens and the placeholder's vision start and end.
    assert usage["prompt_tokens"] == text_only["prompt_tokens"] + 6 + 2


def test_messages_images_also_inside_tool_results(server: HeliosProcess):
    body = {
        "model": "local",
        "max_tokens": 4,
        **NO_THINKING,
        "tools": [{"name": "shot", "description": "Take a screenshot.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": [message_image(png(64, 64, 1)), {"type": "text", "text": "Look."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "here"}, message_image(png(128, 64, 2))],
                    }
                ],
            },
        ],
    }
    response = post(server, "/v1/messages", body)
    assert response.status_code == 200, response.text
    counted = post(server, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})
    usage = response.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    without = post(server, "/v1/messages/count_tokens", {**body, "messages": body["messages"][:1]})
    assert without.json()["input_tokens"] < counted.json()["input_tokens"]


def test_responses_input_image(server: HeliosProcess):
    response = post(
        server,
        "/v1/responses",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{b64(png(64, 96, 3, 'JPEG'))}"},
                        {"type": "input_text", "text": "What is it?"},
                    ],
                }
            ],
            "max_output_tokens": 4,
            "reasoning": {"effort": "low"},
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] > 6


@pytest.mark.parametrize(
    "part,needle",
    [
        (
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            "remote image URLs are not supported",
        ),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "must be base64-encoded"),
        (chat_image(png(8, 8, fmt="GIF"), "image/gif"), "unsupported image media type 'image/gif'"),
        (chat_image(png(8, 8, fmt="GIF")), "image 1 is GIF"),
        (chat_image(b"not an image at all"), "could not be decoded"),
        (chat_image(png(32, 32, fmt="PNG", save_all=True, append_images=[Image.new("RGB", (32, 32))])), "animated"),
        (
            chat_image(
                png(32, 32, fmt="WEBP", save_all=True, append_images=[Image.new("RGB", (32, 32))]), "image/webp"
            ),
            "animated",
        ),
        (chat_image(png(4000, 10, fmt="PNG")), "aspect ratio"),
    ],
)
def test_bad_images_are_400s_in_the_protocols_shape(server: HeliosProcess, part: dict, needle: str):
    response = post(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    )
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_oversized_extent_is_refused_before_decoding(server: HeliosProcess):
    big = io.BytesIO()
    Image.new("RGB", (6000, 6000)).save(big, "PNG")  # 36 MP of one colour: a small file
    response = post(
        server,
        "/v1/messages",
        {"model": "local", "max_tokens": 1, "messages": [{"role": "user", "content": [message_image(big.getvalue())]}]},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "6000x6000 pixels (36000000), more than max_image_pixels 33554432" in error["message"]


def test_image_budget_names_the_whole_request_and_the_first_image_over_it(server: HeliosProcess):
    """42 images of 196 tokens (784 patches) each: 8232 tokens > 8191; image 42 crosses it."""
    flat = io.BytesIO()
    Image.new("RGB", (448, 448), (200, 30, 90)).save(flat, "PNG")  # one colour: small enough for the body limit
    tile = flat.getvalue()
    response = post(
        server,
        "/v1/chat/completions",
        {"max_tokens": 1, "messages": [{"role": "user", "content": [chat_image(tile)] * 42}]},
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "need 8232 image tokens (32928 patches), more than max_image_tokens_per_prompt 8191" in message
    assert "image 42 (448x448 pixels, 196 tokens) crossed the budget" in message


def test_prefix_reuse_over_an_image_follows_its_content(server: HeliosProcess):
    """The same image again reuses the prefix past it with identical seeded output; another image
    of the same size stops reuse at the image; appending an image keeps the earlier turn's reuse."""

    def ask(messages: list) -> dict:
        response = post(
            server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "seed": 7, **NO_THINKING}
        )
        assert response.status_code == 200, response.text
        return response.json()

    def launches() -> int:
        text = httpx.get(server.url + "/metrics").text
        return int(float(text.split('flare_graph_launches_total{kind="vision"} ')[1].split()[0]))

    long_text = "Describe this picture carefully. " * 20
    first = [{"role": "user", "content": [chat_image(png(96, 64, 10)), {"type": "text", "text": long_text}]}]
    cold = ask(first)
    before = launches()
    warm = ask(first)
    assert launches() == before  # the restored prefix covers the image: no preprocessing, no vision graph
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 8 + 100
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    other = [{"role": "user", "content": [chat_image(png(96, 64, 11)), {"type": "text", "text": long_text}]}]
    assert ask(other)["usage"]["prompt_tokens_details"]["cached_tokens"] < 8
    follow = first + [
        {"role": "assistant", "content": cold["choices"][0]["message"]["content"] or "ok"},
        {"role": "user", "content": [chat_image(png(64, 64, 12)), {"type": "text", "text": "And this?"}]},
    ]
    turn = ask(follow)["usage"]
    assert turn["prompt_tokens_details"]["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 16
    assert turn["prompt_tokens_details"]["multimodal_tokens"] == {"image": 6 + 4}


def test_text_only_cores_still_refuse_images(tiny_server: HeliosProcess):
    response = post(
        tiny_server,
        "/v1/chat/completions",
        {"max_tokens": 1, "messages": [{"role": "user", "content": [chat_image(png(32, 32))]}]},
    )
    assert response.status_code == 400
    assert "does not accept image input" in response.json()["error"]["message"]


def test_tiny_checkpoint_is_seeded(tmp_path: Path):
    """The same seed writes the same weights (the checkpoint is reproducible)."""
    recipe = load_recipe("qwen38")
    a = write_tiny_checkpoint(recipe, tmp_path / "a")
    b = write_tiny_checkpoint(recipe, tmp_path / "b")
    for name in sorted(p.name for p in a.glob("*.safetensors")):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_metrics_count_decoded_images_and_reused_features(server: HeliosProcess):
    """The same image after different text: no prefix covers it, so its features come from the
    prepared-input cache and the vision graph does not run again."""

    def metrics() -> dict:
        return httpx.get(server.url + "/metrics?format=json").json()

    image = chat_image(png(80, 48, 20))
    before = metrics()
    for lead in ("First question.", "A different question."):
        response = post(
            server,
            "/v1/chat/completions",
            {
                "max_tokens": 1,
                **NO_THINKING,
                "messages": [{"role": "user", "content": [{"type": "text", "text": lead}, image]}],
            },
        )
        assert response.status_code == 200, response.text
    after = metrics()
    assert after["input_decoded_images_total"] - before["input_decoded_images_total"] == 2
    assert after["input_prepared_cache_misses_total"] - before["input_prepared_cache_misses_total"] == 1
    assert after["input_prepared_cache_hits_total"] - before["input_prepared_cache_hits_total"] == 1
    text = httpx.get(server.url + "/metrics").text
    assert 'flare_graph_launches_total{kind="vision"}' in text
    view = View(server.url)  # `helios top` shows the images beside the other counters
    view.update(Snapshot.from_json(after), 0.0)
    console = Console(width=400, record=True)
    console.print(view.render())
    assert f"images {after['input_decoded_images_total']} (" in console.export_text()


SYSTEM_ONE = {
    "model": "local",
    "state": {"screen": "SHOT", "note": "see SHOT"},
    "questions": {
        "error": {"type": "noul", "instructions": "Does SHOT show an error?"},
        "level": {"type": "score", "criteria": ["calm", "like SHOT"]},
    },
}
DANGER = {"TypeSafe-Danger-Zone-Images": "true"}


def system_one(server: HeliosProcess, body: dict, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/systemone", json=body if not kwargs else None, headers=headers or {}, timeout=120, **kwargs
    )


def test_system_one_image_assets_as_base64(server: HeliosProcess):
    shot = png(64, 48, 30)
    body = {**SYSTEM_ONE, "assets": {"SHOT": {"data_base64": b64(shot)}}}
    response = system_one(server, body, DANGER)
    assert response.status_code == 200, response.text
    result = response.json()
    assert set(result["answers"]) == {"error", "level"}
    assert result["answers"]["level"]["legend"] == ["calm", "like SHOT"]  # references kept as written
    plain = system_one(server, {**SYSTEM_ONE, "state": {"screen": "a screenshot", "note": "see it"}})
    assert plain.status_code == 200, plain.text
    # Each of the two questions' prompts holds the image (4 tokens) three times: state twice, question once.
    assert result["usage"]["input_tokens"] > plain.json()["usage"]["input_tokens"] + 2 * 3 * 4
    refused = [
        (body, {}, "TypeSafe-Danger-Zone-Images"),
        (
            {**SYSTEM_ONE, "assets": {"SHOT": {"data_base64": b64(shot)}, "UNUSED": {"data_base64": b64(shot)}}},
            DANGER,
            "not referenced",
        ),
        ({**SYSTEM_ONE, "assets": {"SHOT": {"data_base64": b64(png(8, 8, fmt="GIF"))}}}, DANGER, "not a PNG or JPEG"),
    ]
    for bad, headers, needle in refused:
        response = system_one(server, bad, headers)
        assert response.status_code == 400, response.text
        assert needle in response.json()["error"]["message"]


def test_system_one_image_assets_as_multipart(server: HeliosProcess):
    shot = png(64, 48, 31)
    request = json.dumps({**SYSTEM_ONE, "assets": {"SHOT": {}}})
    files = [("request", ("request.json", request, "application/json")), ("SHOT", ("shot.png", shot, "image/png"))]
    response = system_one(server, {}, DANGER, files=files)
    assert response.status_code == 200, response.text
    base = {**SYSTEM_ONE, "assets": {"SHOT": {"data_base64": b64(shot)}}}
    same = system_one(server, base, DANGER).json()
    assert response.json()["answers"] == same["answers"]
    stray = files + [("OTHER", ("o.png", shot, "image/png"))]
    assert system_one(server, {}, DANGER, files=stray).status_code == 400
    built = httpx.Request("POST", server.url + "/v1/systemone", files=files)
    compressed = httpx.post(
        server.url + "/v1/systemone",
        content=built.read(),
        headers={**DANGER, "Content-Type": built.headers["Content-Type"], "Content-Encoding": "gzip"},
    )
    assert compressed.status_code == 415


def test_responses_tool_output_images_count(server: HeliosProcess):
    """A function_call_output carrying an input_image (Codex's view_image) reaches the prompt."""

    def body(output: list) -> dict:
        return {
            "max_output_tokens": 4,
            "reasoning": {"effort": "low"},
            "input": [
                {"role": "user", "content": "Show me."},
                {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": output},
            ],
            "tools": [{"type": "function", "name": "view_image", "parameters": {"type": "object"}}],
        }

    text = post(server, "/v1/responses", body([{"type": "input_text", "text": "done"}]))
    image = post(
        server,
        "/v1/responses",
        body(
            [
                {"type": "input_text", "text": "done"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{b64(png(64, 64, 40))}"},
            ]
        ),
    )
    assert text.status_code == image.status_code == 200, image.text
    assert image.json()["usage"]["input_tokens"] == text.json()["usage"]["input_tokens"] + 4 + 2


def test_encoded_size_limit(vision_core: Path):
    """max_image_bytes is checked before decoding (a core's limit, shrunk here to reach it)."""
    vision = dataclasses.replace(Manifest.load(vision_core).vision, max_image_bytes=100)
    with pytest.raises(RequestError, match=r"image 2 is \d+ bytes, more than max_image_bytes 100"):
        prepare_image(png(32, 32), vision, 2)


def test_prompt_logprobs_are_null_at_image_positions(server: HeliosProcess):
    """api.md: the first entry and image positions are null; every text position has its entry."""
    response = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look:"},
                        chat_image(png(96, 64, 50)),
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
            "max_tokens": 1,
            "prompt_logprobs": 2,
            **NO_THINKING,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    entries = body["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"]
    nulls = [i for i, entry in enumerate(entries) if entry is None]
    assert len(nulls) == 1 + 6 and nulls[0] == 0
    assert nulls[1:] == list(range(nulls[1], nulls[1] + 6))  # the image's six tokens, in a run
    assert all(isinstance(entry, dict) and entry for i, entry in enumerate(entries) if i not in nulls)


def test_tiny_checkpoint_without_transformers_says_what_to_install(monkeypatch, tmp_path: Path):
    """transformers is the `tiny` extra, not a serving dependency: its absence is a clear error."""
    monkeypatch.setitem(sys.modules, "transformers.models.qwen3_5_moe", None)
    with pytest.raises(TinyError, match=r"pip install -e '\.\[tiny\]'"):
        write_tiny_checkpoint(load_recipe("qwen38"), tmp_path / "tiny")
