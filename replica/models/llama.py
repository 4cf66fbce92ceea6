"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) and its mixture-of-experts kin
(Mixtral, Qwen2-MoE, Qwen3-MoE), written for the engine.

Pure model code: no LoRA, no scheduling. LoRA is a pass (`lora_core.layers.apply_lora`)
that replaces the fused projections. Tensor parallelism is built in, Megatron style:
with a `TPGroup` of size tp, each rank's attention holds num_heads/tp q heads and
num_kv_heads/tp kv heads (qkv column-parallel, o row-parallel), its MLP
intermediate/tp features (gate_up column-parallel, down row-parallel), or in a
mixture-of-experts layer E/tp whole experts (`replica.models.moe`: expert parallelism); the embedding and
the lm_head are vocab-parallel (`replica.layers.vocab`: each rank holds V/tp rows, V
padded up to a multiple of tp; the embedding all-reduces, the lm_head gathers its logit
shards to rank 0); the norms are replicated, so every rank's hidden states are whole
(Qwen3's and Qwen3-MoE's per-head q/k norms too: each rank applies the whole [head_dim] weight to its
own heads).
Inputs are flattened batches: input_ids: long [T], positions: long [T], plus
paged-attention metadata.
"""

from __future__ import annotations

import torch
from torch import nn

from replica.layers.attention import AttentionMetadata, paged_attention
from replica.layers.linear import QKVParallelLinear, RowParallelLinear
from replica.layers.norm_rope import RMSNorm, RopeTable, RotaryEmbedding, apply_rope
from replica.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from replica.models.config import ModelConfig
from replica.models.mlp import MLP
from replica.models.moe import SparseMoE
from replica.parallel import SINGLE, TPGroup


class Attention(nn.Module):
    """This rank's heads: num_heads/tp query heads, num_kv_heads/tp kv heads."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.layer_windows[layer]
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp
        )
        # Qwen3: each head's q and k RMS-normalised over head_dim, before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(self, x, rope: RopeTable):
        """x: [T, H] -> q [T, heads, d], k and v [T, kv_heads, d], q and k rotated by rope
        (the step's `RotaryEmbedding.table`, DecoderModel): the attention's work that is
        the same kernels for every step of T tokens. Its o_proj runs in
        `DecoderLayer.finish`."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(rope, q, k)
        return q, k, v

    def attend(
        self, q, k, v, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, out=None
    ):
        """The step's new k, v written to the paged cache; -> [T, heads, d] (into `out`
        where given): the part whose work follows the step's sequences, not only its
        token count."""
        return paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window, out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe_layers[layer]:
            self.mlp = SparseMoE(cfg, tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, x, rope: RopeTable, kv, meta):
        q, k, v = self.project(x, rope)
        return self.finish(x, self.self_attn.attend(q, k, v, kv, meta))

    def project(self, x, rope: RopeTable):
        """The residual stream x: [T, H] -> this layer's rotated q, k, v."""
        return self.self_attn.project(self.input_layernorm(x), rope)

    def finish(self, x, attn):
        """x: the residual stream this layer took; attn: [T, heads, d] its attention's
        output -> the residual stream the next layer takes."""
        x = x + self.self_attn.o_proj(attn.flatten(1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """embed -> layers -> norm. `layers` is what LoRA and TP passes walk. The RoPE table of
    the step's positions is computed once here and shared by every layer."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv, meta)
        return self.norm(x)


class CausalLM(nn.Module):
    """The decoder plus the LM head; one class serves all seven architectures.

    tp: the TP group this copy is rank `tp.rank` of. Every rank holds a V/tp shard of the
    lm_head (tied: the embedding's shard) and computes its shard of the logits; only the
    driver (rank 0) samples, so the shards are gathered there, not to every rank. A whole
    head on rank 0 alone (V x H: 1 GB for an 8B model's 128k vocabulary in bf16) would
    leave rank 0 less KV cache than the others and make its GEMM every step's straggler.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """-> hidden states [T, H]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, H] -> float32 logits [n, V] on rank 0; None on the other ranks,
        which must make the same calls (with the same n: the shards are gathered)."""
        return self.lm_head(hidden)
