"""The tensors (Hugging Face names and shapes) an Architecture implies, and a check against them."""

from __future__ import annotations

import numpy as np

from helios.manifest import Architecture
from ignition.checkpoints.base import CheckpointError
from ignition.models import MODEL_TYPES, PLANNED_MODEL_TYPES

SUPPORTED_FAMILIES = ("qwen2", "llama")


def check_family(family: str, source: str) -> str:
    """The flare family of a checkpoint's model type (a Hugging Face model_type or GGUF
    architecture): qwen2/llama, a configured family, or a planned one (export refuses those)."""
    if family in SUPPORTED_FAMILIES:
        return family
    if family in MODEL_TYPES:
        return MODEL_TYPES[family]
    if family in PLANNED_MODEL_TYPES:
        return PLANNED_MODEL_TYPES[family]
    known = [*SUPPORTED_FAMILIES, *sorted(MODEL_TYPES)]
    raise CheckpointError(f"{source} is a {family!r} model; flare supports {', '.join(known)}")


def expected_tensor_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_heads * head_dim, arch.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    for i in range(arch.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_out, hidden),
            layer + "self_attn.k_proj.weight": (kv_out, hidden),
            layer + "self_attn.v_proj.weight": (kv_out, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_out),
            layer + "mlp.gate_proj.weight": (arch.intermediate_size, hidden),
            layer + "mlp.up_proj.weight": (arch.intermediate_size, hidden),
            layer + "mlp.down_proj.weight": (hidden, arch.intermediate_size),
        }
        if arch.attention_bias:
            shapes |= {
                layer + "self_attn.q_proj.bias": (q_out,),
                layer + "self_attn.k_proj.bias": (kv_out,),
                layer + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


def check_tensor_shapes(tensors: dict[str, np.ndarray], arch: Architecture, source: str) -> None:
    """Raise CheckpointError unless `tensors` holds exactly the tensors `arch` needs, shaped right."""
    expected = expected_tensor_shapes(arch)
    problems = [f"missing {name}" for name in expected if name not in tensors]
    problems += [f"unexpected {name}" for name in tensors if name not in expected]
    problems += [
        f"{name} has shape {list(tensors[name].shape)}, expected {list(shape)}"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"{source} does not match its {arch.family} architecture: {shown}")
