"""Image input (api.md "Images"): decode and check what a client sent, size it with the core's
profile, and place it in the prompt.

Every protocol decoder leaves an `ImagePart` (encoded bytes and a media type) in the neutral
conversation. `prepare_images` decodes each with Pillow (PNG, JPEG and static WebP only), applies
the byte and pixel limits, resizes its grid by the profile's rules (the checkpoint's image
processor: sides multiples of patch * merge, area within [min_pixels, max_pixels]) and costs it
(patches / merge^2 image tokens). `expand_placeholders` then turns each image's placeholder
token in the rendered prompt into that many tokens and records where they sit, which is what
the engine (helios/engine/vision.py) needs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from helios.engine.api import ImageInput
from helios.manifest import Manifest, Vision
from helios.neutral.conversation import ImagePart
from helios.neutral.errors import RequestError

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
ALLOWED = "base64 PNG, JPEG or static WebP data"
MAX_ASPECT = 200  # the Qwen image processor refuses more elongated images


@dataclass
class PreparedImage:
    """A decoded, checked and costed image (its pixels are resized lazily, in the engine)."""

    width: int
    height: int
    pixels: np.ndarray  # RGB uint8 [height, width, 3]
    size: tuple[int, int]  # (height, width) after the profile's resizing
    grid: tuple[int, int]  # (rows, cols) of encoder patches
    patches: int
    tokens: int
    digest: bytes


def decode_data_url(url: str, param: str) -> tuple[bytes, str]:
    """(bytes, media type) of a `data:image/...;base64,...` URL; remote URLs are refused."""
    if not url.startswith("data:"):
        raise RequestError(f"remote image URLs are not supported; send {ALLOWED} as a data URL", param=param)
    header, _, payload = url[5:].partition(",")
    media, *params = header.split(";")  # data:image/png[;name=value...];base64,DATA
    if not params or params[-1].strip().lower() != "base64":
        raise RequestError(f"image data URLs must be base64-encoded ({ALLOWED})", param=param)
    media = media.strip().lower()
    return decode_base64(payload, media, param), media


def decode_base64(data: str, media_type: str, param: str) -> bytes:
    if media_type not in MEDIA_TYPES:
        raise RequestError(f"unsupported image media type {media_type!r}; images must be {ALLOWED}", param=param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("image data is not valid base64", param=param) from None


def profile_grid(height: int, width: int, vision: Vision) -> tuple[int, int]:
    """(rows, cols) of patches the profile resizes an image to (transformers' smart_resize)."""
    factor = vision.patch_size * vision.merge_size
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    if rows * cols > vision.max_pixels:
        beta = math.sqrt(height * width / vision.max_pixels)
        rows = max(factor, math.floor(height / beta / factor) * factor)
        cols = max(factor, math.floor(width / beta / factor) * factor)
    elif rows * cols < vision.min_pixels:
        beta = math.sqrt(vision.min_pixels / (height * width))
        rows, cols = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return rows // vision.patch_size, cols // vision.patch_size


def prepare_image(data: bytes, vision: Vision, position: int) -> PreparedImage:
    """Decode and cost one image (`position`: its 1-based place in the request, for messages). The
    decoded format decides, whatever media type the client declared (decoders checked that one)."""
    where = f"image {position}"
    if len(data) > vision.max_image_bytes:
        raise RequestError(
            f"{where} is {len(data)} bytes, more than max_image_bytes {vision.max_image_bytes}", param="messages"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in ("PNG", "JPEG", "WEBP"):
                raise RequestError(
                    f"{where} is {image.format or 'an unknown format'}; images must be {ALLOWED}", param="messages"
                )
            if getattr(image, "is_animated", False) or getattr(image, "n_frames", 1) > 1:
                raise RequestError(f"{where} is animated; animated images are unsupported", param="messages")
            width, height = image.size
            if width * height > vision.max_image_pixels:
                raise RequestError(
                    f"{where} is {width}x{height} pixels ({width * height}), more than "
                    f"max_image_pixels {vision.max_image_pixels}",
                    param="messages",
                )
            pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except RequestError:
        raise
    except (
        UnidentifiedImageError,
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise RequestError(f"{where} could not be decoded as {ALLOWED}: {exc}", param="messages") from None
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT:
        raise RequestError(
            f"{where} is {width}x{height} pixels: its aspect ratio exceeds {MAX_ASPECT}:1", param="messages"
        )
    rows, cols = profile_grid(height, width, vision)
    patches = rows * cols
    tokens = patches // vision.merge_size**2
    if tokens > vision.max_image_tokens_per_image:
        raise RequestError(
            f"{where} ({width}x{height} pixels) needs {tokens} image tokens ({patches} patches), more "
            f"than max_image_tokens_per_image {vision.max_image_tokens_per_image}",
            param="messages",
        )
    digest = hashlib.blake2b(pixels.tobytes(), digest_size=16, person=b"flare-image")
    digest.update(repr((pixels.shape, rows, cols, vision.image_mean, vision.image_std, vision.resample)).encode())
    size = (rows * vision.patch_size, cols * vision.patch_size)
    return PreparedImage(width, height, pixels, size, (rows, cols), patches, tokens, digest.digest())


def check_budget(images: list[PreparedImage], budget: int) -> None:
    """Cost every image, then refuse a request whose image tokens exceed `budget` (api.md wording:
    the whole request's tokens and patches, the first image that crossed the budget)."""
    total = sum(i.tokens for i in images)
    if total <= budget:
        return
    running = 0
    for position, image in enumerate(images, start=1):
        running += image.tokens
        if running > budget:
            raise RequestError(
                f"the request's images need {total} image tokens ({sum(i.patches for i in images)} patches), more "
                f"than max_image_tokens_per_prompt {budget}; image {position} ({image.width}x{image.height} pixels, "
                f"{image.tokens} tokens) crossed the budget",
                param="messages",
            )


def image_budget(manifest: Manifest) -> int:
    """max_image_tokens_per_prompt: images share the context with text and output (card field)."""
    return manifest.limits.context_length - 1 if manifest.vision is not None else 0


def max_images(manifest: Manifest) -> int:
    """max_images_per_prompt: the smallest image's tokens plus its framing, across the context."""
    vision = manifest.vision
    if vision is None:
        return 0
    smallest = max(1, vision.min_pixels // (vision.patch_size * vision.merge_size) ** 2)
    framing = 2  # the placeholder's start and end tokens around the image tokens
    return max(1, (manifest.limits.context_length - 1) // (smallest + framing))


def prepare_images(parts: list[ImagePart], manifest: Manifest) -> list[PreparedImage]:
    """Decode and cost the conversation's images (in the order the template writes them), check
    the request's budget, and give each part the core's placeholder text."""
    if not parts:
        return []
    vision = manifest.vision
    if vision is None:
        raise RequestError("this model core does not accept image input", param="messages")
    prepared = [prepare_image(part.data, vision, k) for k, part in enumerate(parts, start=1)]
    check_budget(prepared, image_budget(manifest))
    for part in parts:
        part.placeholder = vision.placeholder
    return prepared


def expand_placeholders(
    ids: list[int], images: list[PreparedImage], image_token_id: int
) -> tuple[list[int], list[ImageInput], list[int]]:
    """(ids with each image's token repeated image.tokens times, the engine's ImageInputs in prompt
    order, and for each original position its position in the expanded ids)."""
    found = [i for i, token in enumerate(ids) if token == image_token_id]
    if len(found) != len(images):
        raise RequestError(
            "the prompt text contains the model's image placeholder token outside an image part", param="messages"
        )
    out: list[int] = []
    inputs: list[ImageInput] = []
    moved = [0] * (len(ids) + 1)
    slots = {position: k for k, position in enumerate(found)}
    for i, token in enumerate(ids):
        moved[i] = len(out)
        if i in slots:
            image = images[slots[i]]
            inputs.append(
                ImageInput(
                    offset=len(out),
                    tokens=image.tokens,
                    grid=image.grid,
                    size=image.size,
                    pixels=image.pixels,
                    digest=image.digest,
                )
            )
            out.extend([token] * image.tokens)
        else:
            out.append(token)
    moved[len(ids)] = len(out)
    return out, inputs, moved
