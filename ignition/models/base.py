"""What every family's model class is: a step-graph module (docs/architecture.md) that also
answers, as class methods, what the exporter asks of its family before any tensor is read."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from helios.manifest import Architecture, StateLayout

TOP_K = 20  # natural alternatives the step graph returns (manifest Logprobs.max_top_logprobs)


class FamilyError(ValueError):
    pass


def logprob_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-distribution statistics of logits [N, V] in fp32: (log-softmax [N, V], logsumexp [N],
    the TOP_K best logprobs [N, K] (decreasing; ONNX TopK breaks ties by lower id) and their ids).
    Shared by the step graph and the prompt-scoring head so both report identical numbers."""
    # onnxruntime's LogSoftmax is vectorized; its ReduceLogSumExp over a 152k vocabulary is
    # ~6x slower. logsumexp = max logit - max logprob (both at the top-1 id): exact to fp32.
    logprobs = torch.log_softmax(logits, dim=-1)
    top_logprobs, top_ids = torch.topk(logprobs, TOP_K, dim=-1)
    lse = torch.gather(logits, 1, top_ids[:, :1]).squeeze(1) - top_logprobs[:, 0]
    return logprobs, lse, top_logprobs, top_ids


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal wrapper's `text_config`, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and inner else config


class StepModel(nn.Module):
    """Base of every family's model class. `family` is the flare family name, `model_types` the
    Hugging Face model_type values compiled as it (multimodal wrappers compile their text model)."""

    family: str = ""
    model_types: tuple[str, ...] = ()
    arch: Architecture
    lm_head: nn.Linear
    # A multimodal step graph (a vision tower is exported beside it): its rotary axes' frequency
    # counts (t, h, w); the graph then takes mrope_positions / image_embeds / image_slots.
    mrope_section: list[int] | None = None
    # Floats of recurrent state a sequence keeps per layer stack (0: the pool's K/V is all its state).
    state_width: int = 0

    @classmethod
    def architecture(cls, config: dict[str, Any]) -> Architecture:
        """The manifest Architecture of a checkpoint's config.json."""
        raise NotImplementedError(f"the checkpoint readers derive the {cls.family} architecture")

    @classmethod
    def cache_layout(cls, config: dict[str, Any], num_layers: int) -> tuple[int, StateLayout | None]:
        """(layers with K/V rows in the pool, the recurrent state layout or None)."""
        return num_layers, None

    @classmethod
    def logit_postprocessing(cls, config: dict[str, Any]) -> str | None:
        """What the family does to its logits after the lm_head (None: nothing)."""
        return None

    @classmethod
    def attention_window(cls, config: dict[str, Any]) -> int | None:
        """The window every attending layer keeps to (None: some layer reads all history)."""
        return None

    @classmethod
    def build(cls, arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> StepModel:
        """A float32 eval-mode model holding the checkpoint's weights."""
        raise NotImplementedError

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def step_outputs(
        self,
        normed: torch.Tensor,
        query_lens: torch.Tensor,
        logprob_token_ids: torch.Tensor,
        logit_rows: torch.Tensor | None = None,
        logit_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """(logits [N, V], logsumexp [N], top_logprobs [N, K], top_ids [N, K], token_logprobs [N, E])
        at N output positions of the final-normed hidden states [B, L, H]: position
        logit_positions[n] of row logit_rows[n] (a verification round asks for several positions
        of one row). Without them, each row's last valid token (N = B)."""
        batch, length, hidden = normed.shape
        if logit_rows is None or logit_positions is None:
            logit_rows = torch.arange(batch, dtype=torch.int64)
            logit_positions = query_lens - 1
        flat = normed.reshape(batch * length, hidden)
        # The head in fp32 whatever the weights' dtype (a no-op in an fp32 model): exact
        # logsumexp, top-20 and explicit ids in a bf16 torch program too.
        logits = self.logits_of(torch.index_select(flat, 0, logit_rows * length + logit_positions)).float()
        logprobs, lse, top_logprobs, top_ids = logprob_stats(logits)
        # Explicit ids: gathered from the full-vocabulary log-softmax (api.md logprob_token_ids).
        token_logprobs = torch.gather(logprobs, 1, torch.index_select(logprob_token_ids, 0, logit_rows))
        return logits, lse, top_logprobs, top_ids, token_logprobs
