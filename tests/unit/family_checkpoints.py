"""Tiny random checkpoints of the recipe families, written by transformers itself.

Each family's reference implementation (transformers 5.24) builds a 2-5 layer model with a small
hidden size and a few experts from a seeded config, and `save_pretrained` writes it as the real
checkpoints are laid out (sharded safetensors with model.safetensors.index.json, per-expert or
fused expert tensors as each family's hub checkpoints have them). Weights
are re-drawn larger than transformers' init (std 0.02 leaves logits nearly flat, which would hide
errors), and biases/norms that init to constants are randomised so dropping one shows.

The tokenizer is ignition.tiny_text's byte-level BPE plus the family's control tokens, so any
text round-trips and the family's delimiters are single tokens.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from ignition.tiny_text import QWEN_SPECIALS, write_byte_tokenizer, write_text_checkpoint

# Control tokens each family's template and parsers use (single tokens in the real tokenizers).
SPECIALS = {
    "deepseek_v3": [
        "[BOS]",
        "[EOS]",
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|im_tool|>",
    ],
    "mimo_v2_flash": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    "step3p7": [
        "<|begin_of_sentence|>",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    "muse_spark": [
        "<|begin_of_text|>",
        "<|eot|>",
        "<|header_start|>",
        "<|header_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
    ],
    "glm_moe_dsa": [
        "[gMASK]",
        "<sop>",
        "<|endoftext|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<tool_response>",
        "</tool_response>",
    ],
    "minimax_m3_vl": ["]~!b[", "[e~[", "]~b]", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"],
    "gemma4": [
        "<bos>",
        "<eos>",
        "<pad>",
        "<|turn>",
        "<turn|>",
        "<|channel>",
        "<channel|>",
        "<|think|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool>",
        "<tool|>",
        "<|tool_response>",
        "<tool_response|>",
        '<|"|>',
    ],
    "qwen3": QWEN_SPECIALS,
    "mistral": ["<s>", "</s>", "[INST]", "[/INST]"],
    # SmolLM3's vocabulary spells the end of text as Llama 3 does.
    "smollm3": ["<|end_of_text|>", *QWEN_SPECIALS[1:]],
    "gemma3": ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"],
    "gemma2": ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "qwen3_5": QWEN_SPECIALS,
    "qwen3_5_moe": QWEN_SPECIALS,
    "nemotron_h": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    "deepseek_v4": [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜DSML｜function_calls>",
        "</｜DSML｜function_calls>",
    ],
}

EOS = {
    "qwen3": "<|im_end|>",
    "mistral": "</s>",
    "gemma3": "<end_of_turn>",
    "gemma2": "<end_of_turn>",
    "phi3": "<|end|>",
    "smollm3": "<|im_end|>",
    "qwen3_5": "<|im_end|>",
    "qwen3_5_moe": "<|im_end|>",
    "deepseek_v3": "<|im_end|>",
    "mimo_v2_flash": "<|im_end|>",
    "gemma4": "<turn|>",
    "step3p7": "<|im_end|>",
    "muse_spark": "<|eot|>",
    "glm_moe_dsa": "<|user|>",
    "minimax_m3_vl": "[e~[",
    "nemotron_h": "<|im_end|>",
    "deepseek_v4": "<｜end▁of▁sentence｜>",
}

# Every MoE family routes 4 of 32 experts (group-limited families: 4 groups, 2 kept), so the parity
# tests exercise dispatch at realistic sparsity with each family's routing.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # SmolLM3: every fourth layer without rotary (NoPE), tied embeddings.
    "smollm3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=2000000.0,
        no_rope_layer_interval=2,
    ),
    # Gemma 3's layout in miniature: five sliding layers (a window shorter than the parity
    # prompts) then a global one, head_dim wider than hidden/heads, query_pre_attn_scalar, and the
    # 4B-and-larger linear-scaled rotary on the global layer.
    "gemma3": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=24,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=4096,
    ),
    # Gemma 2's layout in miniature: sliding and global layers alternating (the window shorter
    # than the parity prompts), caps small enough that tanh bends the tiny model's scores and logits.
    "gemma2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        max_position_embeddings=4096,
    ),
    # Phi-3-mini's shape in miniature (fused qkv and gate_up in the checkpoint), with Phi-4-mini's
    # partial rotary and a window shorter than the parity prompts.
    "phi3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        sliding_window=24,
        tie_word_embeddings=False,
    ),
    # Mistral 7B v0.1's shape in miniature: every layer windowed, the window shorter than the
    # parity test's prompts so keys leave it during prefill and decode.
    "mistral": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=24,
        tie_word_embeddings=False,
    ),
    # Qwen3 dense: GQA with q/k RMSNorms before rotary, untied (as Qwen3-8B and larger).
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Kimi K2.5's text model: MLA (q LoRA, interleaved YaRN rotary) + sigmoid group-limited MoE
    # with a shared expert, first layer dense.
    "deepseek_v3": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # YaRN as Kimi K2's checkpoints use it (scaled so the tiny prompts cross its correction range;
        # mscale != mscale_all_dim so the cos/sin attention factor is not 1).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    ),
    # MiMo-V2-Flash: sliding (window 7, sinks, doubled KV heads) / full layers, q/k head 24 vs v 16,
    # partial rotary with per-type theta, value scale, sigmoid MoE without shared experts.
    "mimo_v2_flash": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        n_routed_experts=32,
        num_experts_per_tok=4,
        head_dim=24,
        v_head_dim=16,
        sliding_window=7,
        max_position_embeddings=4096,
        layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse"],
        attention_value_scale=0.707,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
        },
        tie_word_embeddings=False,
    ),
    # Step 3.5/3.7 text: sliding layers with more query heads, per-type partial rotary and theta,
    # (1 + w) norms incl. QK norms, head-wise sigmoid output gates, a 1/sqrt(query_pre_attn_scalar)
    # scale, clamped SwiGLU experts/shared expert and the sigmoid router with bias.
    "step3p7": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=32,
        num_experts_per_tok=4,
        share_expert_dim=32,
        layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse"],
        sliding_window=6,
        num_sliding_attention_heads=8,
        swiglu_limits=[None, 1.5],
        swiglu_limits_shared=[1.0, 1.5],
        moe_router_scaling_factor=2.0,
        query_pre_attn_scalar=12,
        max_position_embeddings=4096,
        rope_theta=[10000.0, 5000.0],
        partial_rotary_factors=[0.5, 1.0],
    ),
    # GLM-5: MLA (q LoRA, interleaved rotary) with the DSA indexer selecting each query's top 9
    # keys (so long prompts exercise it), a shared-indexer layer, dense then sigmoid-routed MoE;
    # 16 indexer heads, so exact all-zero ReLU ties (where top-k order is arbitrary) stay improbable.
    "glm_moe_dsa": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        routed_scaling_factor=2.5,
        index_topk=9,
        index_head_dim=16,
        index_n_heads=16,
        mlp_layer_types=["dense", "sparse"],
        indexer_types=["full", "shared"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # MiniMax M3 text: a block-sparse layer (indexer over 4-token key blocks, 3 blocks kept per query
    # incl. its own), (1 + w) norms incl. QK norms, clamped SwiGLU-alpha dense MLP, experts and
    # shared expert, sigmoid router with bias and routed scaling.
    "minimax_m3_vl": dict(
        hidden_size=64,
        intermediate_size=32,
        dense_intermediate_size=96,
        shared_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=32,
        num_experts_per_tok=4,
        mlp_layer_types=["dense", "sparse"],
        layer_types=["full_attention", "minimax_m3_sparse"],
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=3,
        index_local_blocks=1,
        swiglu_limit=1.5,
        routed_scaling_factor=2.0,
        max_position_embeddings=4096,
    ),
    # Muse Spark text: sliding / NoPE-full layers, unscaled QK norms with a query scale, per-head
    # output norms and sigmoid gates, residual gates, (1 + w) and input-scaled norms, projected-width
    # experts with per-expert output norms, embedding norm, logit multiplier and soft-cap.
    "muse_spark": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        layer_rope_theta=[500000.0, 0],
        mlp_layer_types=["dense", "sparse"],
        moe_intermediate_size=32,
        moe_hidden_size=48,
        num_local_experts=32,
        num_experts_per_tok=4,
        routed_scaling_factor=1.5,
        final_logit_softcapping=20.0,
        qk_scale_factor=2.0,
        output_multiplier=0.5,
        residual_gate_temperature=0.3,
        post_norm_eps=1e-8,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    # Gemma 4 with every text feature at once: sliding (window 6) / global layers with wider global
    # heads (32 vs 16), one global KV head with K=V, proportional partial rotary, a KV-shared last
    # layer, per-layer inputs (PLE), the parallel expert block and a final logit soft-cap.
    "gemma4": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=1,
        enable_moe_block=True,
        num_experts=32,
        top_k_experts=4,
        moe_intermediate_size=32,
        final_logit_softcapping=30.0,
        max_position_embeddings=4096,
    ),
    # Qwen 3.5 dense: gated DeltaNet layers (2 key heads serving 4 value heads, kernel-4 causal conv)
    # around a gated full-attention layer ((1 + w) QK norms, partial interleaved-mrope rotary).
    "qwen3_5": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    ),
    # Qwen 3.5 MoE: the same hybrid stack with softmax-routed experts (fused gate_up_proj) and a
    # sigmoid-gated shared expert on every layer.
    "qwen3_5_moe": dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    ),
    # Nemotron-H with every layer kind: Mamba-2 (2 groups, kernel-4 conv with bias, projection
    # biases), GQA attention without positions, a squared-ReLU MLP with biases, and group-routed
    # squared-ReLU experts in a latent width with a shared expert ("ME*M-").
    "nemotron_h": dict(
        hidden_size=64,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mlp_bias=True,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        use_bias=True,
        use_conv_bias=True,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=24,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # DeepSeek-V4 (tests/unit/test_deepseek_v4.py's CONFIG with 32 experts): sliding, heavily compressed and
    # compressed sparse layers (compress rates 4 and 2, so windows complete every few tokens; an
    # indexer top-3 that drops entries), hash-routed then top-k MoE with clamped SwiGLU, 2
    # hyper-connection streams, grouped low-rank output, YaRN compress rotary, a 6-token window.
    "deepseek_v4": dict(
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=24,
        partial_rotary_factor=0.5,
        num_experts_per_tok=4,
        n_routed_experts=32,
        layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        hc_mult=2,
        hc_sinkhorn_iters=4,
        sliding_window=6,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=16,
        index_head_dim=8,
        index_topk=3,
        swiglu_limit=1.5,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}


# family -> (transformers module, config class, causal-LM class); None: the local text-only
# wrapper defined below (transformers ships those models only with their vision towers).
_CLASSES: dict[str, tuple[str, str, str | None]] = {
    "smollm3": ("transformers.models.smollm3", "SmolLM3Config", "SmolLM3ForCausalLM"),
    "gemma3": ("transformers.models.gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("transformers.models.gemma2", "Gemma2Config", "Gemma2ForCausalLM"),
    "mistral": ("transformers.models.mistral", "MistralConfig", "MistralForCausalLM"),
    "phi3": ("transformers.models.phi3", "Phi3Config", "Phi3ForCausalLM"),
    "qwen3": ("transformers.models.qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_5": ("transformers.models.qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "nemotron_h": ("transformers", "NemotronHConfig", "NemotronHForCausalLM"),
    "deepseek_v4": ("transformers", "DeepseekV4Config", "DeepseekV4ForCausalLM"),
    "deepseek_v3": ("transformers.models.deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "mimo_v2_flash": ("transformers.models.mimo_v2_flash", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM"),
    "gemma4": ("transformers.models.gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM"),
    "step3p7": ("transformers.models.step3p7.configuration_step3p7", "Step3p7TextConfig", None),
    "glm_moe_dsa": ("transformers.models.glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "minimax_m3_vl": ("transformers.models.minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM"),
    "muse_spark": ("transformers.models.muse_spark.configuration_muse_spark", "MuseSparkTextConfig", None),
}


def _classes(family: str):
    module_name, config_name, model_name = _CLASSES[family]
    module = importlib.import_module(module_name)
    local = {"step3p7": StepCausalLM, "muse_spark": MuseCausalLM}
    return getattr(module, config_name), getattr(module, model_name) if model_name else local[family]


class StepCausalLM(torch.nn.Module):
    """Step3p7TextModel plus an lm_head: the text path of Step3p7ForConditionalGeneration (which
    transformers ships only with its vision tower). Saved in the hub checkpoints' original layout."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

        self.config = config
        self.model = Step3p7TextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.lm_head(self.model(input_ids).last_hidden_state))

    def save_pretrained(self, folder: Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for name, value in self.state_dict().items():
            for old, new in (
                (".mlp.gate.weight", ".moe.gate.weight"),
                (".mlp.gate.e_score_correction_bias", ".moe.router_bias"),
                (".mlp.experts.down_proj", ".moe.down_proj.weight"),
                (".mlp.shared_experts.", ".share_expert."),
            ):
                name = name.replace(old, new)
            if name.endswith(".mlp.experts.gate_up_proj"):
                inter = value.shape[1] // 2
                base = name.removesuffix(".mlp.experts.gate_up_proj")
                tensors[base + ".moe.gate_proj.weight"] = value[:, :inter].contiguous()
                tensors[base + ".moe.up_proj.weight"] = value[:, inter:].contiguous()
                continue
            tensors[name] = value.contiguous()
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(self.config.to_json_string())


class MuseCausalLM(torch.nn.Module):
    """MuseSparkTextModel plus an lm_head with MuseSparkForConditionalGeneration's logit path
    (output_multiplier, then the final soft-cap); saved as the multimodal checkpoint lays the text
    model out (`model.language_model.*`, `lm_head.weight`)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTextModel

        self.config = config
        self.model = MuseSparkTextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        from types import SimpleNamespace

        logits = self.lm_head(self.model(input_ids).last_hidden_state) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return SimpleNamespace(logits=torch.tanh(logits / cap) * cap)

    def save_pretrained(self, folder: Path) -> None:
        from safetensors.torch import save_file

        tensors = {
            (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v.contiguous()
            for k, v in self.state_dict().items()
        }
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(self.config.to_json_string())


def build_reference(family: str, seed: int = 0, overrides: dict[str, Any] | None = None):
    """The transformers model of a tiny `family` checkpoint (eval, float32, eager attention);
    `overrides` replace TINY_CONFIGS entries (e.g. more experts)."""
    config_cls, model_cls = _classes(family)
    specials = SPECIALS[family]
    vocab = 256 + len(specials)
    eos = 256 + specials.index(EOS[family])
    extra = {"vocab_size_per_layer_input": vocab} if family == "gemma4" else {}
    config = config_cls(
        vocab_size=vocab,
        bos_token_id=256,
        eos_token_id=eos,
        pad_token_id=eos,
        **{**TINY_CONFIGS[family], **(overrides or {})},
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if family in ("step3p7", "muse_spark"):
        model.model.config._attn_implementation = "eager"
    generator = torch.Generator().manual_seed(seed + 1)
    if family == "deepseek_v4":
        randomise_deepseek_v4(model, generator)
        return model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("per_expert_scale", "router.scale")):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("sinks", "residual_gate.gate", "mixer.D")) or "bias" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 0.3 * torch.randn(buffer.shape, generator=generator))
    return model


def randomise_deepseek_v4(model, generator: torch.Generator) -> None:
    """Weights redrawn larger than transformers' init (flat logits would hide errors); the
    hyper-connection (and hyper head) bases and scales, sinks and compressor position biases
    randomised, and a token -> experts table (tid2eid) that routes tokens differently
    (transformers' init leaves all of these constant; some rows name one expert twice)."""
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("sinks", "base", "position_bias")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith("scale"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("tid2eid"):  # some rows name one expert twice
                buffer.copy_(torch.randint(0, experts, buffer.shape, generator=generator))


def write_family_checkpoint(
    folder: Path, family: str, seed: int = 0, overrides: dict[str, Any] | None = None
) -> tuple[Path, Any]:
    """Write the tiny checkpoint of `family` into `folder`; return (folder, reference model)."""
    folder = Path(folder)
    model = build_reference(family, seed, overrides)
    if isinstance(model, torch.nn.Module) and hasattr(model, "can_generate"):
        # Sharded, as the real checkpoints are: model-0000N-of-0000M.safetensors + the index.
        model.save_pretrained(folder, max_shard_size="300KB")
    else:
        model.save_pretrained(folder)
    write_tokenizer_files(folder, family)
    return folder, model


def write_tokenizer_files(folder: Path, family: str) -> None:
    write_byte_tokenizer(folder, SPECIALS[family], EOS[family])


def write_quantizable_checkpoint(
    folder: Path,
    family: str,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    embedding_std: float | None = None,
) -> Path:
    """A tiny checkpoint of `family` that a quantized (default int4) export validates.

    write_family_checkpoint's re-drawn weights make a chaotic network: int4 noise on one weight
    changes every later logit, so its int4 export fails validation (KL ~1.4 nats) although the
    engine is right (fp32 parity 3e-5). transformers' own initialisation keeps the tiny network
    contractive, and tied embeddings make each next-token distribution peaked, as a trained
    model's are (int4: KL ~2e-4, top-1 1.0 on the validation prompt)."""
    config_cls, model_cls = _classes(family)
    text_config = {**TINY_CONFIGS[family], **(overrides or {})}
    return write_text_checkpoint(
        folder, config_cls, model_cls, SPECIALS[family], EOS[family], text_config, seed, embedding_std
    )
