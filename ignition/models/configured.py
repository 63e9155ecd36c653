"""Config-driven step models: `ConfiguredLM`, built from a per-layer description (`LayerPlan`,
plans.py) that a family module (ignition/models/<family>.py) derives from the checkpoint's Hugging
Face config. It implements the step-graph contract of docs/architecture.md over the shared blocks
(ignition/models/blocks): attention layers (GQA or absorbed MLA) in pre-norm residual blocks with
a gated MLP or experts, recurrent layers (blocks/recurrent.py MIXERS) and feed-forward-only
layers. A family subclasses ConfiguredLM to name its attention class, build its own layers
(`make_layer`), embed (`embed`), or read its own checkpoint names (`rename`, `load`).

MTP heads are not part of the step graph: the loader keeps their tensors aside (`mtp_tensors`)
and the exporter writes them into the core for later speculative decoding.

The paged pool keeps the contract's uniform geometry [layers*2*P, page_tokens, kv_heads,
head_dim]: its kv_heads/head_dim are the largest any layer needs, and a layer with fewer heads
or narrower heads uses the leading part of each slot (the rest stays zero).

A plain GQA layer runs on flare's pool kernel (`adopt_pool_kernel`, blocks/attention.py); the
other layers are plain torch ops over their gathered pages.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helios.manifest import Architecture, StateLayer, StateLayout
from ignition.models.base import StepModel, text_config
from ignition.models.blocks.attention import GQAttention, MLAttention, PagedPool, StepState, layer_inv_freq
from ignition.models.blocks.loading import TensorLoader, check_fully_loaded, text_tensors
from ignition.models.blocks.mlp import MoE, SwiGLU
from ignition.models.blocks.norms import RMSNorm
from ignition.models.blocks.recurrent import MIXERS, RecurrentMixer
from ignition.models.plans import LayerPlan, ModelPlan
from ignition.models.rope_config import scaled_context


def make_mlp(plan: LayerPlan, hidden: int) -> nn.Module:
    return MoE(plan.moe, hidden) if plan.moe else SwiGLU(hidden, plan.intermediate, plan.glu)


class PreNormLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float, head_eps: float, attention: type[nn.Module]) -> None:
        super().__init__()
        self.plan = plan
        # The hot norms (these, the final norm, the attention's QK norms) in the form onnxruntime
        # fuses: one node instead of seven each, ~100 fewer nodes a step on a 4-layer MoE.
        self.input_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset, fusable=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset, fusable=True)
        self.self_attn = attention(plan, hidden, head_eps)
        self.mlp = make_mlp(plan, hidden)

    def forward(self, x, step, past_k, past_v, shared=None, per_layer_input=None):
        attn, k, v = self.self_attn(self.input_layernorm(x), step, past_k, past_v, shared)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v

    def load(self, loader: TensorLoader, p: str) -> None:
        loader.norm(self.input_layernorm, p + "input_layernorm")
        loader.norm(self.post_attention_layernorm, p + "post_attention_layernorm")
        self.self_attn.load(loader, p + "self_attn.")
        self.mlp.load(loader, p + "mlp.")


class RecurrentLayer(nn.Module):
    """Pre-norm residual block around a recurrent mixer, with an optional MLP (none when the plan
    has neither experts nor an intermediate width)."""

    def __init__(self, plan: LayerPlan, hidden: int, eps: float) -> None:
        super().__init__()
        self.plan = plan
        self.input_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset, fusable=True)
        self.mixer: RecurrentMixer = MIXERS[plan.kind].build(plan, hidden, eps)
        self.has_mlp = bool(plan.moe or plan.intermediate)
        if self.has_mlp:
            self.post_attention_layernorm = RMSNorm(hidden, eps, offset=plan.norm_offset, fusable=True)
            self.mlp = make_mlp(plan, hidden)

    def forward(self, x, state, valid):
        h, new_state = self.mixer(self.input_layernorm(x), state, valid)
        x = x + h
        if self.has_mlp:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_state

    def load(self, loader: TensorLoader, p: str) -> None:
        """The mixer under `linear_attn.` (the Hugging Face name of a linear-attention mixer)."""
        loader.norm(self.input_layernorm, p + "input_layernorm")
        self.mixer.load(loader, p + "linear_attn.")
        if self.has_mlp:
            loader.norm(self.post_attention_layernorm, p + "post_attention_layernorm")
            self.mlp.load(loader, p + "mlp.")


class ConfiguredLM(StepModel):
    """The step graph for a `ModelPlan` (same inputs and outputs as decoder.DecoderLM).

    A plan with recurrent layers (LayerPlan.recurrent) gives a state-bearing graph: two more
    inputs, `state_pool` [S, W] and `state_slots` [B], and one more output, `new_state` [B, W]
    (docs/architecture.md, "Recurrent state"). The paged pool then holds only the attention
    layers (`kv_layers`), in order."""

    attention: type[nn.Module] = GQAttention  # the attention block of PreNormLayer

    @staticmethod
    def planner(cfg: dict[str, Any]) -> ModelPlan:
        """The family's ModelPlan of a (text) config.json."""
        raise NotImplementedError

    def __init__(self, arch: Architecture, plan: ModelPlan) -> None:
        super().__init__()
        self.arch = arch
        self.plan = plan
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(p) for p in plan.layers)
        self.kv_layers = plan.kv_layers()
        self._kv_index = {layer: j for j, layer in enumerate(self.kv_layers)}
        self.state_layout = plan.state_layers(arch.hidden_size)
        self.state_width = sum(size for _, _, _, size in self.state_layout)
        self.pool_kernel_layers: set[int] = set()  # adopt_pool_kernel's layers: they read pages in place
        self.norm = RMSNorm(arch.hidden_size, plan.rms_norm_eps, offset=plan.final_norm_offset, fusable=True)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.mtp_tensors: dict[str, np.ndarray] = {}

    def make_layer(self, plan: LayerPlan) -> nn.Module:
        if plan.recurrent:
            return RecurrentLayer(plan, self.arch.hidden_size, self.plan.rms_norm_eps)
        eps, head_eps = self.plan.rms_norm_eps, self.plan.head_norm_eps
        return PreNormLayer(plan, self.arch.hidden_size, eps, head_eps, self.attention)

    # -- what the exporter asks before any tensor is read ---------------------------------------

    @classmethod
    def architecture(cls, config: dict[str, Any]) -> Architecture:
        """The pool geometry is the widest layer's."""
        cfg = text_config(config)
        plan = cls.planner(cfg)
        kv_heads, head_dim = plan.cache_dims()
        first = plan.layers[0]
        return Architecture(
            family=cls.family,
            num_layers=len(plan.layers),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_heads=first.num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=first.rope_theta,
            rms_norm_eps=plan.rms_norm_eps,
            max_position_embeddings=scaled_context(int(cfg.get("max_position_embeddings") or 4096), plan.rope_scaling),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            attention_bias=False,
            rope_scaling=plan.rope_scaling,
        )

    @classmethod
    def cache_layout(cls, config: dict[str, Any], num_layers: int) -> tuple[int, StateLayout | None]:
        cfg = text_config(config)
        plan = cls.planner(cfg)
        slices = plan.state_layers(int(cfg["hidden_size"]))
        if not slices:
            return len(plan.kv_layers()), None
        layers = [StateLayer(layer=i, kind=kind, offset=offset, size=size) for i, kind, offset, size in slices]
        return len(plan.kv_layers()), StateLayout(width=sum(s.size for s in layers), layers=layers)

    @classmethod
    def attention_window(cls, config: dict[str, Any]) -> int | None:
        """The widest window when every attending layer has one (their history is gathered from
        the window's pages only, StepState.window_columns), else None."""
        windows = [layer.window for layer in cls.planner(text_config(config)).layers if layer.attends]
        if not windows or None in windows:
            return None
        return max(w for w in windows if w is not None)

    @classmethod
    def logit_postprocessing(cls, config: dict[str, Any]) -> str | None:
        """The prompt-scoring graph is the bare lm_head, so such a family cannot score prompts:
        export refuses --prompt-logprobs before any tensor is read."""
        plan = cls.planner(text_config(config))
        if plan.final_softcap:
            return f"it soft-caps its logits after the lm_head (final_logit_softcapping={plan.final_softcap:g})"
        if plan.logit_multiplier != 1.0:
            return f"it scales its logits after the lm_head (by {plan.logit_multiplier:g})"
        return None

    @classmethod
    def build(cls, arch: Architecture, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> ConfiguredLM:
        with torch.device("meta"):
            model = cls(arch, cls.planner(text_config(config)))
        for module in model.modules():  # rotary frequencies are computed, never loaded
            if isinstance(module, (GQAttention, MLAttention)):
                module.inv_freq = layer_inv_freq(module.plan)
        model.load(tensors)
        model.adopt_pool_kernel()
        for module in list(model.modules()):  # (fusing edits the module tree)
            if isinstance(module, SwiGLU):
                module.fuse_gate_up()
        return model.eval().requires_grad_(False)

    def adopt_pool_kernel(self) -> None:
        """Put every attention layer that fits it on the pool kernel (GQAttention.fits_pool_kernel),
        except the layers whose keys and values later layers share (those read them in the
        checkpoint's layout)."""
        sources = {p.kv_source for p in self.plan.layers if p.kv_source is not None}
        for i, layer in enumerate(self.layers):
            attention = next((m for m in layer.children() if isinstance(m, GQAttention)), None)
            if (
                attention is not None
                and i not in sources
                and attention.fits_pool_kernel(self.arch.num_kv_heads, self.arch.head_dim)
            ):
                attention.use_pool_kernel(self._kv_index[i])
                self.pool_kernel_layers.add(i)

    # -- the step graph ---------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token embeddings [B, L, H], per-layer inputs [B, L, layers, d] or None)."""
        x = self.embed_tokens(input_ids)
        if self.plan.embed_scale != 1.0:
            x = x * torch.tensor(self.plan.embed_scale, dtype=torch.float32)
        return x, None

    def _history(self, kv_pool, block_tables, layer: int, windowed: bool = False):
        """Layer's history keys and values [B, G, pages * page_tokens, D] from the pages the
        table names (a windowed layer's table: its window's columns, StepState.window_columns)."""
        batch, pages = block_tables.shape
        num_pages = kv_pool.shape[0] // (2 * len(self.kv_layers))
        _, tokens, heads, dim = kv_pool.shape
        j = self._kv_index[layer]
        out = []
        for kind in (0, 1):
            rows = (2 * j + kind) * num_pages + block_tables  # [B, pages]
            if windowed:  # a reshape to B * (the window's width) makes torch.export guard on it
                kv = kv_pool[rows].flatten(1, 2)  # a GatherND of pool rows
            else:
                kv = torch.index_select(kv_pool, 0, rows.reshape(-1)).reshape(batch, pages * tokens, heads, dim)
            out.append(kv.transpose(1, 2))
        return out

    def hidden_states(
        self,
        input_ids,
        positions,
        history_lens,
        block_tables,
        kv_pool,
        query_lens=None,
        state=None,
        images=None,
    ):
        """Final-normed hidden states [B, L, H], the attention layers' new (k, v) padded to the pool,
        and the recurrent layers' new state [B, W] (None without recurrent layers).

        state: [B, W] each row's state after its history (zeros for none given); query_lens: valid
        new tokens per row (all L when None); images: (mrope positions [3, B, L], image features
        [I, H], their flat token slots [I] = row * L + position) of a multimodal step graph."""
        heads, dim = self.arch.num_kv_heads, self.arch.head_dim
        x, per_layer = self.embed(input_ids)
        mrope = None
        if images is not None:
            mrope_positions, embeds, slots = images
            batch, length, hidden = x.shape
            x = x.reshape(batch * length, hidden).index_copy(0, slots, embeds).reshape(batch, length, hidden)
            mrope = (mrope_positions, self.mrope_section)
        if query_lens is None:
            query_lens = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.int64)
        pool = PagedPool(kv_pool, block_tables, query_lens, len(self.kv_layers))
        step = StepState(positions, history_lens, mrope, pool)
        new_kv, produced, new_state = [], {}, []
        valid = None
        if self.state_width:
            batch, length = input_ids.shape
            if state is None:
                state = torch.zeros(batch, self.state_width)
            valid = torch.arange(length).unsqueeze(0) < query_lens.unsqueeze(1)
        slices = {layer: (offset, size) for layer, _, offset, size in self.state_layout}
        for i, layer in enumerate(self.layers):
            if i in slices:
                offset, size = slices[i]
                x, s = layer(x, state[:, offset : offset + size], valid)
                new_state.append(s)
                continue
            if not layer.plan.attends:  # a feed-forward block alone
                x = layer.feed_forward(x)
                continue
            source = layer.plan.kv_source
            if i in self.pool_kernel_layers:
                past_k = past_v = None  # the pool kernel reads the pages in place
            else:
                window = layer.plan.window
                table = (
                    block_tables if window is None else torch.gather(block_tables, 1, step.window_columns(window)[0])
                )
                past_k, past_v = self._history(kv_pool, table, i if source is None else source, window is not None)
            shared = produced[source] if source is not None else None
            ple = per_layer[:, :, i] if per_layer is not None else None
            x, k, v = layer(x, step, past_k, past_v, shared, ple)
            produced[i] = (k, v)
            for t in (k, v):
                pad = (0, dim - t.shape[-1], 0, heads - t.shape[-2])
                new_kv.append(F.pad(t, pad) if any(pad) else t)
        return self.norm(x), new_kv, (torch.cat(new_state, dim=-1) if new_state else None)

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        if self.plan.logit_multiplier != 1.0:
            logits = logits * self.plan.logit_multiplier
        if self.plan.final_softcap:
            logits = torch.tanh(logits / self.plan.final_softcap) * self.plan.final_softcap
        return logits

    def forward(
        self,
        input_ids,
        positions,
        history_lens,
        query_lens,
        block_tables,
        kv_pool,
        logprob_token_ids,
        logit_rows=None,
        logit_positions=None,
        state_pool=None,
        state_slots=None,
        mrope_positions=None,
        image_embeds=None,
        image_slots=None,
    ):
        state = None
        images = None if mrope_positions is None else (mrope_positions, image_embeds, image_slots)
        if self.state_width:
            # Each row continues its slot's state; a row without history starts from zeros, so a
            # fresh slot needs no zeroing (and stale contents, even non-finite ones, never leak).
            gathered = torch.index_select(state_pool, 0, state_slots)
            state = torch.where((history_lens > 0).unsqueeze(1), gathered, torch.zeros_like(gathered))
        normed, new_kv, new_state = self.hidden_states(
            input_ids, positions, history_lens, block_tables, kv_pool, query_lens, state, images
        )
        batch, length, _ = normed.shape
        outputs = self.step_outputs(normed, query_lens, logprob_token_ids, logit_rows, logit_positions)
        kv = torch.stack(new_kv, dim=0).reshape(
            len(self.kv_layers), 2, batch, length, self.arch.num_kv_heads, self.arch.head_dim
        )
        if new_state is not None:
            return *outputs, kv, normed, new_state
        return *outputs, kv, normed

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of one whole sequence as a single prefill over an empty pool."""
        length = ids.shape[0]
        pool = torch.zeros(2 * len(self.kv_layers), 1, self.arch.num_kv_heads, self.arch.head_dim)
        normed, _, _ = self.hidden_states(
            ids.unsqueeze(0),
            torch.arange(length).unsqueeze(0),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64),
            pool,
        )
        return self.logits_of(normed[0])

    # -- loading ----------------------------------------------------------------------------------

    @staticmethod
    def rename(name: str) -> str:
        """A checkpoint tensor's (text) name as the Hugging Face module name the blocks load."""
        return name

    def load_embeddings(self, loader: TensorLoader) -> None:
        loader.put(self.embed_tokens, "weight", loader.take("model.embed_tokens.weight"))

    def load(self, tensors: dict[str, np.ndarray]) -> None:
        """Set every parameter from HF-named tensors; MTP layers (model.layers.N.* for N >= the
        decoder's layer count, model.mtp.*, or top-level mtp.*) are kept aside in mtp_tensors under
        their text names. Every other tensor must be used."""
        text, _ = text_tensors(tensors)
        names = {self.rename(name): name for name in text}
        loader = TensorLoader({new: text[old] for new, old in names.items()})
        self.load_embeddings(loader)
        for i, layer in enumerate(self.layers):
            layer.load(loader, f"model.layers.{i}.")
        loader.put(self.norm, "weight", loader.take("model.norm.weight"))
        loader.lm_head(self)
        n = self.arch.num_layers
        mtp = re.compile(r"^(?:model\.layers\.(\d+)\.|(model\.)?mtp\.)")
        for name in set(loader.tensors) - loader.used:
            match = mtp.match(names[name])
            if match and (match.group(1) is None or int(match.group(1)) >= n):
                self.mtp_tensors[names[name]] = np.asarray(loader.tensors[name])
                loader.used.add(name)
        check_fully_loaded(self, loader.tensors, loader.used)
