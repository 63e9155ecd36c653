"""Export a checkpoint's vision tower (ignition/models/qwen3_5_vision.py) as the core's vision
graph: one image's patches in, its image-token features out, every size through one graph."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import torch

from helios.manifest import Engine, TensorSpec, Vision
from ignition.checkpoints.base import Checkpoint
from ignition.export.graph import OPSET, save_with_external_data
from ignition.export.options import ExportError
from ignition.models.qwen3_5 import mrope_axes
from ignition.models.qwen3_5_vision import Qwen35VisionTower

VISION_GRAPH_FILE = "vision.onnx"
VISION_INPUT_NAMES = ["patches", "patch_rows_cols", "table_ids", "table_weights"]


def export_vision_graph(tower: Qwen35VisionTower, out_dir: Path) -> Engine:
    """Write out_dir/vision.onnx (+ .data) and return its engine entry."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    width = tower.patch_embed.in_features
    merged = tower.merge**2
    count = 3 * merged  # three merged tokens in the trace
    sample = (
        torch.randn(count, width),
        torch.randint(0, 4, (count, 2)),
        torch.randint(0, tower.position_grid**2, (count, 4)),
        torch.rand(count, 4),
    )
    tokens = torch.export.Dim("T", min=1)
    patches = merged * tokens
    dynamic = ({0: patches}, {0: patches}, {0: patches}, {0: patches})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            tower,
            sample,
            input_names=VISION_INPUT_NAMES,
            output_names=["features"],
            dynamic_shapes=dynamic,
            opset_version=OPSET,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    for value in list(proto.graph.input) + list(proto.graph.output):
        first = value.type.tensor_type.shape.dim[0]
        first.Clear()
        first.dim_param = "T" if value.name == "features" else "P"
    save_with_external_data(proto, out_dir / VISION_GRAPH_FILE, VISION_GRAPH_FILE + ".data")
    return vision_engine(proto)


def vision_engine(proto: onnx.ModelProto) -> Engine:
    """The manifest's entry for a vision graph: P patches in, T = P / merge^2 features out."""
    width = proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    out_hidden = proto.graph.output[0].type.tensor_type.shape.dim[1].dim_value
    inputs = [
        TensorSpec("patches", "float32", ["P", width]),
        TensorSpec("patch_rows_cols", "int64", ["P", 2]),
        TensorSpec("table_ids", "int64", ["P", 4]),
        TensorSpec("table_weights", "float32", ["P", 4]),
    ]
    outputs = [TensorSpec("features", "float32", ["T", out_hidden])]
    return Engine("vision", VISION_GRAPH_FILE, inputs, outputs, data_files=[VISION_GRAPH_FILE + ".data"])


# Qwen 3.5's image processor (its preprocessor_config.json), for checkpoints that carry none.
DEFAULT_PROFILE = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216},
}
# Decoded extent and encoded size accepted before any resizing (api.md max_image_pixels / _bytes):
# past Pillow's own decompression-bomb guard would be refused by the decoder anyway.
MAX_IMAGE_PIXELS = 33_554_432
MAX_IMAGE_BYTES = 20 * 1024 * 1024


def vision_spec(checkpoint: Checkpoint, engine: Engine, context_length: int) -> Vision:
    """The manifest's image section: the checkpoint's image processor profile, the placeholder
    its template writes per image, and the limits one image and one feature window take."""
    config, profile = checkpoint.model_config, {**DEFAULT_PROFILE, **checkpoint.image_processor}
    vision = config["vision_config"]
    patch, merge = int(vision.get("patch_size", 16)), int(vision.get("spatial_merge_size", 2))
    temporal = int(vision.get("temporal_patch_size", 2))
    if (int(profile["patch_size"]), int(profile["merge_size"]), int(profile["temporal_patch_size"])) != (
        patch,
        merge,
        temporal,
    ):
        raise ExportError("the checkpoint's image processor and vision tower disagree on patch, merge or temporal size")
    size = profile.get("size") or {}
    min_pixels = int(profile.get("min_pixels") or size.get("shortest_edge") or DEFAULT_PROFILE["size"]["shortest_edge"])
    max_pixels = int(profile.get("max_pixels") or size.get("longest_edge") or DEFAULT_PROFILE["size"]["longest_edge"])
    names = {token_id: text for text, token_id in checkpoint.special_tokens.items()}
    ids = [config.get("vision_start_token_id"), config.get("image_token_id"), config.get("vision_end_token_id")]
    if any(i is None or int(i) not in names for i in ids):
        raise ExportError(f"the tokenizer lacks the vision start / image / end tokens {ids} the config names")
    per_image = max_pixels // (patch * merge) ** 2
    window = min(per_image, context_length)
    section = mrope_axes(config)
    return Vision(
        engine=engine.name,
        patch_size=patch,
        temporal_patch_size=temporal,
        merge_size=merge,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=[float(v) for v in profile["image_mean"]],
        image_std=[float(v) for v in profile["image_std"]],
        resample="bicubic",
        position_grid=int(int(vision["num_position_embeddings"]) ** 0.5),
        image_token_id=int(ids[1]),
        placeholder="".join(names[int(i)] for i in ids),
        mrope_section=section,
        max_image_tokens_per_image=window,
        max_image_pixels=MAX_IMAGE_PIXELS,
        max_image_bytes=MAX_IMAGE_BYTES,
        image_feature_window_tokens=window,
    )
