"""Llama-family decoder (Llama, Mistral, Qwen2) written for the engine.

Pure model code: no LoRA, no scheduling. LoRA is a pass (`lora_core.layers.apply_lora`)
that replaces the fused projections; tensor parallelism would be another pass over
the TP-ready linears. Inputs are flattened batches: input_ids: long [T],
positions: long [T], plus paged-attention metadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.attention import AttentionMetadata, paged_attention
from replica.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from replica.layers.norm_rope import RMSNorm, RotaryEmbedding
from replica.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.layer_windows[layer]
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, x, positions, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        """x: [T, H] -> [T, H]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, (cfg.intermediate_size,) * 2
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """embed -> layers -> norm. `layers` is what LoRA and TP passes walk."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, kv, meta)
        return self.norm(x)


class CausalLM(nn.Module):
    """The decoder plus the LM head; one class serves all three architectures."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """-> hidden states [T, H]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, H] -> float32 logits [n, V]."""
        return self.lm_head(hidden).float()
