"""Vision graphs against transformers: `ignition tiny-checkpoint` writes a tiny random
Qwen3_5(Moe)ForConditionalGeneration with the real Qwen tokenizer; its fp32 core's vision graph
and multimodal step graph must match transformers' image features and logits within 1e-4
relative, for an image + text prompt, chunked prefill across an image, two images in one prompt
and batched rows; helios' image processing must match transformers' Qwen2VL processor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helios.engine.api import ImageInput
from helios.engine.runner import Runner, StepRow
from helios.engine.vision import VisionEncoder, patchify, rope_positions
from helios.manifest import Manifest
from helios.neutral.images import profile_grid
from ignition.recipes import load_recipe
from ignition.tiny import write_tiny_checkpoint
from tests.conftest import export

TOLERANCE = 1e-4
RECIPES = {"qwen3_5": "qwen38_dense", "qwen3_5_moe": "qwen38"}


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB picture (gradients plus noise), so resampling has something to do."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8), "RGB")


class Tiny:
    def __init__(self, folder: Path, core: Path) -> None:
        self.folder, self.core = folder, core
        self.manifest = Manifest.load(core)
        self.vision = self.manifest.vision
        self.reference = None

    def model(self):
        if self.reference is None:
            from transformers import AutoModelForImageTextToText

            self.reference = AutoModelForImageTextToText.from_pretrained(self.folder).eval()
        return self.reference

    def processor(self):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        profile = json.loads((self.folder / "preprocessor_config.json").read_text())
        profile.pop("image_processor_type")
        return Qwen2VLImageProcessorPil(**profile)

    def image(self, picture: Image.Image, offset: int) -> tuple[ImageInput, torch.Tensor, torch.Tensor]:
        """(ImageInput at `offset`, transformers' pixel_values and grid for it)."""
        out = self.processor()(images=[picture], return_tensors="pt")
        _, rows, cols = out["image_grid_thw"][0].tolist()
        ps = self.vision.patch_size
        image = ImageInput(
            offset=offset,
            tokens=rows * cols // self.vision.merge_size**2,
            grid=(rows, cols),
            size=(rows * ps, cols * ps),
            pixels=np.asarray(picture),
            digest=b"%d" % offset,
        )
        return image, out["pixel_values"], out["image_grid_thw"]


@pytest.fixture(scope="module", params=sorted(RECIPES))
def tiny(request, tmp_path_factory) -> Tiny:
    family = request.param
    folder = write_tiny_checkpoint(load_recipe(RECIPES[family]), tmp_path_factory.mktemp(f"tiny-{family}"))
    core = export(RECIPES[family], str(folder), tmp_path_factory.mktemp("cores") / family, "fp32")
    return Tiny(folder, core)


def prompt(tiny: Tiny, pictures: list[Image.Image]) -> tuple[list[int], list[ImageInput], torch.Tensor, torch.Tensor]:
    """ids: text, then each picture framed by vision start/end and text after it."""
    ids, images, pixels, grids = [11, 22, 33], [], [], []
    for k, pic in enumerate(pictures):
        ids.append(151652)
        image, values, grid = tiny.image(pic, len(ids))
        ids += [tiny.vision.image_token_id] * image.tokens + [151653] + [44 + k, 55, 66]
        images.append(image)
        pixels.append(values)
        grids.append(grid)
    return ids, images, torch.cat(pixels), torch.cat(grids)


def reference_logits(tiny: Tiny, ids: list[int], pixels: torch.Tensor, grids: torch.Tensor) -> np.ndarray:
    image_token = tiny.vision.image_token_id
    with torch.no_grad():
        out = tiny.model()(
            input_ids=torch.tensor([ids]),
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=torch.tensor([[int(t == image_token) for t in ids]]),
        )
    return out.logits[0].numpy()


def row(
    ids: list[int],
    images: list[ImageInput],
    features: list[np.ndarray],
    start: int,
    count: int,
    slot: int,
    pages: list[int],
    merge: int,
) -> StepRow:
    """A step row feeding ids[start:start+count] with every position's outputs."""
    offsets, parts = [], []
    for image, values in zip(images, features):
        lo, hi = max(start, image.offset), min(start + count, image.offset + image.tokens)
        if lo < hi:
            offsets += list(range(lo - start, hi - start))
            parts.append(values[lo - image.offset : hi - image.offset])
    return StepRow(
        token_ids=ids[start : start + count],
        history_len=start,
        block_table=pages,
        state_slot=slot,
        output_positions=list(range(count)),
        rope_positions=rope_positions(images, start, count, merge),
        image_features=(np.array(offsets), np.concatenate(parts)) if parts else None,
    )


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_image_processing_matches_transformers(tiny: Tiny):
    for width, height, seed in [(96, 64, 0), (37, 211, 1), (700, 500, 2), (20, 20, 3)]:
        pic = picture(width, height, seed)
        image, pixels, grid = tiny.image(pic, 0)
        assert profile_grid(height, width, tiny.vision) == image.grid == tuple(grid[0, 1:].tolist())
        assert np.abs(patchify(image, tiny.vision) - pixels.numpy()).max() < 1e-5


def test_vision_graph_matches_transformers(tiny: Tiny):
    encoder = VisionEncoder(tiny.core, tiny.manifest)
    for pic in (picture(96, 64, 0), picture(300, 180, 1)):
        image, pixels, grid = tiny.image(pic, 0)
        with torch.no_grad():
            expected = tiny.model().model.get_image_features(pixels, grid).pooler_output[0].numpy()
        assert relative(encoder.encode(image), expected) < TOLERANCE


def test_step_graph_logits_match_transformers(tiny: Tiny):
    """One image (whole prefill and chunked across the image), two images, and a batch of two
    rows of different prompts in one step."""
    encoder, merge = VisionEncoder(tiny.core, tiny.manifest), tiny.vision.merge_size
    runner = Runner(tiny.core, tiny.manifest, num_pages=64)
    pages = iter(range(64))
    one = prompt(tiny, [picture(96, 64, 0)])
    two = prompt(tiny, [picture(160, 96, 1), picture(64, 128, 2)])
    cases = {}
    for name, (ids, images, pixels, grids) in {"one": one, "two": two}.items():
        features = [encoder.encode(image) for image in images]
        table = [next(pages) for _ in range(4)]
        cases[name] = (ids, images, features, table, reference_logits(tiny, ids, pixels, grids))
    ids, images, features, table, expected = cases["one"]
    whole = runner.step([row(ids, images, features, 0, len(ids), 0, table, merge)])
    assert relative(whole.logits, expected) < TOLERANCE
    cut = images[0].offset + 3  # inside the image
    first = runner.step([row(ids, images, features, 0, cut, 1, table, merge)])
    second = runner.step([row(ids, images, features, cut, len(ids) - cut, 1, table, merge)])
    assert relative(np.concatenate([first.logits, second.logits]), expected) < TOLERANCE
    # Two images in one prompt, batched beside the one-image prompt (each row its own pages).
    rows = [
        row(*cases[name][:3], 0, len(cases[name][0]), slot, cases[name][3], merge)
        for slot, name in ((2, "two"), (3, "one"))
    ]
    out = runner.step(rows)
    for b, name in enumerate(("two", "one")):
        n = len(cases[name][0])
        got = out.logits[out.index(b) : out.index(b) + n]
        assert relative(got, cases[name][4]) < TOLERANCE


def test_decode_positions_continue_past_the_images(tiny: Tiny):
    """A decode token after images sits at index + delta on every axis (transformers' rope
    deltas): the delta of a 4x6-patch image is max(2, 3) - 6 = -3."""
    image, _, _ = tiny.image(picture(96, 64, 0), 4)
    assert image.grid == (4, 6) and image.tokens == 6
    positions = rope_positions([image], 0, 12, 2)
    assert positions[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    assert positions[:, 4:10].tolist() == [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    assert positions[:, 10:].tolist() == [[7, 8]] * 3
    assert rope_positions([image], 20, 1, 2).tolist() == [[17]] * 3
