"""Image features and multimodal positions for a core with a vision graph (manifest `vision`,
docs/architecture.md "Images").

An image reaches the engine as an `ImageInput` (helios/engine/api.py): decoded pixels, the grid
the profile resized it to, and where its tokens sit in the prompt. Here it is resized, scaled,
normalized and cut into patches exactly as the checkpoint's image processor does (Pillow
resampling, then the patch order of transformers' Qwen2VL processor), the grid bookkeeping the
vision graph takes is computed, and the graph runs: one call per image, lazily, when a prefill
chunk first reaches the image's tokens (a restored prefix that covers an image never runs it).

Positions: the step graph's rotary follows (t, h, w) positions. Text tokens have all three at
`index + delta`, where delta sums, over the images before them, (the larger merged grid side) -
(the image's tokens); an image's tokens sit at t = start, h = start + row, w = start + col,
start = its first token's index + the delta before it (transformers' get_rope_index).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

from helios.engine.api import ImageInput
from helios.engine.runner import StepRow
from helios.engine.sequence import Sequence
from helios.kernels.session import open_session
from helios.manifest import Manifest, Vision

# Encoded features kept by image digest (a preempted sequence, or the same image in the next turn
# before its prefix is reused, skips the vision graph).
FEATURE_CACHE_BYTES = 64 * 1024 * 1024
RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def patchify(image: ImageInput, vision: Vision) -> np.ndarray:
    """[patches, C * T * ps * ps] float32 in merge-block order (transformers' Qwen2VL processor)."""
    height, width = image.size
    resized = Image.fromarray(image.pixels, "RGB").resize((width, height), RESAMPLE[vision.resample])
    pixels = np.asarray(resized, dtype=np.float32) * np.float32(1 / 255)
    pixels = (pixels - np.asarray(vision.image_mean, np.float32)) / np.asarray(vision.image_std, np.float32)
    ps, merge, temporal = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    rows, cols = height // ps, width // ps
    chw = pixels.transpose(2, 0, 1)
    blocks = chw.reshape(3, rows // merge, merge, ps, cols // merge, merge, ps).transpose(1, 4, 2, 5, 0, 3, 6)
    repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, ps, ps))
    return np.ascontiguousarray(repeated.reshape(rows * cols, 3 * temporal * ps * ps), dtype=np.float32)


def grid_inputs(rows: int, cols: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each patch in merge-block order: its (row, col) [P, 2] and the 4 entries of the
    learned side x side position table it resamples bilinearly (align_corners) with their
    weights [P, 4] (transformers' get_vision_interpolation_indices_and_weights)."""
    within = np.arange(rows * cols)
    blocks_w = cols // merge
    row = (within // (merge * merge * blocks_w)) * merge + (within // merge) % merge
    col = ((within // (merge * merge)) % blocks_w) * merge + within % merge

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(source)
        taps = floor.astype(np.int64)[:, None] + np.arange(2)
        weights = np.clip(1 - np.abs(source[:, None] - floor[:, None] - np.arange(2)), 0, None)
        return np.clip(taps, 0, side - 1), weights.astype(np.float32)

    h_taps, h_weights = axis(row, rows)
    w_taps, w_weights = axis(col, cols)
    ids = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return np.stack([row, col], axis=1).astype(np.int64), ids, weights


class VisionEncoder:
    """Runs the core's vision graph, one image per call."""

    def __init__(self, core_dir: Path, manifest: Manifest, threads: int | None = None) -> None:
        assert manifest.vision is not None
        self.vision = manifest.vision
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session, _ = open_session(
            Path(core_dir) / manifest.engine(self.vision.engine).file, opts, ["CPUExecutionProvider"]
        )
        self.images_total = 0

    def encode(self, image: ImageInput) -> np.ndarray:
        """Image-token features [image.tokens, hidden]."""
        rows, cols = image.grid
        rows_cols, ids, weights = grid_inputs(rows, cols, self.vision.merge_size, self.vision.position_grid)
        (features,) = self.session.run(
            None,
            {
                "patches": patchify(image, self.vision),
                "patch_rows_cols": rows_cols,
                "table_ids": ids,
                "table_weights": weights,
            },
        )
        self.images_total += 1
        if features.shape[0] != image.tokens:
            raise RuntimeError(f"the vision graph made {features.shape[0]} features for {image.tokens} image tokens")
        return features


def merged_grid(image: ImageInput, merge: int) -> tuple[int, int]:
    return image.grid[0] // merge, image.grid[1] // merge


def rope_positions(images: list[ImageInput], start: int, count: int, merge: int) -> np.ndarray:
    """(t, h, w) rotary positions [3, count] of the tokens start .. start+count-1 of a sequence
    whose prompt holds `images` (in prompt order)."""
    index = np.arange(start, start + count, dtype=np.int64)
    out = np.repeat(index[None], 3, axis=0)
    delta = 0
    for image in images:
        rows, cols = merged_grid(image, merge)
        end = image.offset + image.tokens
        inside = (index >= image.offset) & (index < end)
        if inside.any():
            local = index[inside] - image.offset
            base = image.offset + delta
            out[0, inside] = base
            out[1, inside] = base + local // cols
            out[2, inside] = base + local % cols
        delta += max(rows, cols) - image.tokens
        after = index >= end
        out[:, after] = index[after] + delta
    return out


def identity_id(image: ImageInput) -> int:
    """The id an image's tokens carry in the engine's sequence (never fed to the model): negative,
    from the image's digest, so prefix identity (checkpoints, the host store) includes the image
    content and its processing settings, not just its size."""
    return -1 - int.from_bytes(image.digest[:6], "little")


class ImagePlacer:
    """What the engine does for images: marks each sequence's image tokens with identity ids,
    and gives each step row its rotary positions and the features of the image tokens it feeds
    (encoded on first use, kept in a small LRU by digest so a preempted or repeated image is not
    encoded twice)."""

    def __init__(self, encoder: VisionEncoder | None, cache_bytes: int = FEATURE_CACHE_BYTES) -> None:
        """encoder None: a text-only core's placer, which has nothing to do."""
        self.encoder = encoder
        self.vision = encoder.vision if encoder is not None else None
        self.cache_bytes = cache_bytes
        self._features: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.decoded = self.feature_hits = self.feature_misses = 0

    @classmethod
    def for_core(cls, core_dir: Path, manifest: Manifest, threads: int | None = None) -> ImagePlacer:
        return cls(VisionEncoder(core_dir, manifest, threads) if manifest.vision is not None else None)

    def mark(self, seq: Sequence) -> None:
        """Give the sequence's image tokens their identity ids (its request carries real ids)."""
        request = seq.request
        if not request.images:
            return
        if self.vision is None:
            raise ValueError("this model core does not accept image input")
        for image in request.images:
            seq.token_ids[image.offset : image.offset + image.tokens] = [identity_id(image)] * image.tokens
        self.decoded += len(request.images)

    def counters(self) -> dict[str, int]:
        """api.md's image counters (Prometheus names without flare_): images decoded for
        generation requests, and the prepared-input cache (encoded features by image digest)."""
        return {
            "input_decoded_images_total": self.decoded,
            "input_prepared_cache_hits_total": self.feature_hits,
            "input_prepared_cache_misses_total": self.feature_misses,
            "vision_graph_launches": self.encoder.images_total if self.encoder is not None else 0,
        }

    def place(self, rows: list[StepRow], seqs: list[Sequence]) -> None:
        """Fill each row's rope_positions and image_features (rows of text-only sequences keep the
        default positions)."""
        if self.vision is None:
            return
        merge = self.vision.merge_size
        for row, seq in zip(rows, seqs):
            images = seq.request.images
            if not images:
                continue
            row.token_ids = [self.vision.image_token_id if t < 0 else t for t in row.token_ids]
            start, count = row.history_len, len(row.token_ids)
            row.rope_positions = rope_positions(images, start, count, merge)
            offsets, parts = [], []
            for image in images:
                lo, hi = max(start, image.offset), min(start + count, image.offset + image.tokens)
                if lo < hi:
                    offsets.extend(range(lo - start, hi - start))
                    parts.append(self.features(image)[lo - image.offset : hi - image.offset])
            if parts:
                row.image_features = (np.asarray(offsets, dtype=np.int64), np.concatenate(parts))

    def features(self, image: ImageInput) -> np.ndarray:
        found = self._features.get(image.digest)
        if found is not None:
            self._features.move_to_end(image.digest)
            self.feature_hits += 1
            return found
        assert self.encoder is not None
        self.feature_misses += 1
        features = self.encoder.encode(image)
        self._features[image.digest] = features
        while sum(f.nbytes for f in self._features.values()) > self.cache_bytes and len(self._features) > 1:
            self._features.popitem(last=False)
        return features
