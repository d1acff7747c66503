"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) with tensor parallelism applied at load.

Runs in every TP rank. Each rank holds its query heads, its KV heads (replicated when TP > KV heads),
its slice of the MLP, and its slice of the output vocabulary; `o_proj` and `down_proj` all-reduce.
Weights come from a `get(name)` callable so the same code serves any safetensors layout; a weight it
returns may be quantized (quant.py), and is sliced for this rank before it is packed.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.model.attention import AttentionMetadata, paged_attention
from pdserve.model.fused import add_rms_norm, rope_write_kv, silu_mul
from pdserve.model.fused_decode import FusedDecode
from pdserve.model.embedding import Embedding
from pdserve.model.layers import RotaryEmbedding, rms_norm
from pdserve.model.linear import Int8Linear, make_linear, weight_bytes
from pdserve.model.parallel import TPGroup, check_tp_size, kv_head_range, shard_range
from pdserve.model.quant import Weight, cast, cat_rows, cols, pad_rows, rows
from pdserve.model.spec import ModelSpec

WeightGetter = Callable[[str], Weight]


class DecoderLayer:
    def __init__(self, spec: ModelSpec, tp: TPGroup, get: WeightGetter, prefix: str,
                 dtype: torch.dtype, rope: RotaryEmbedding):
        self.spec, self.tp, self.rope = spec, tp, rope
        d = spec.head_dim
        self.num_heads = spec.num_heads // tp.size
        heads = range(tp.rank * self.num_heads, (tp.rank + 1) * self.num_heads)
        kv_heads = kv_head_range(tp.rank, tp.size, spec.num_kv_heads)
        self.num_kv_heads = len(kv_heads)
        q_rows = slice(heads.start * d, heads.stop * d)
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)

        def w(name: str) -> Weight:
            return cast(get(f"{prefix}.{name}"), dtype)

        attn = "self_attn"
        self.qkv_proj = make_linear(cat_rows([
            rows(w(f"{attn}.q_proj.weight"), q_rows),
            rows(w(f"{attn}.k_proj.weight"), kv_rows),
            rows(w(f"{attn}.v_proj.weight"), kv_rows),
        ]), dtype)
        self.qkv_bias = None
        if spec.qkv_bias:
            self.qkv_bias = torch.cat([
                w(f"{attn}.q_proj.bias")[q_rows],
                w(f"{attn}.k_proj.bias")[kv_rows],
                w(f"{attn}.v_proj.bias")[kv_rows],
            ]).contiguous()
        self.o_proj = make_linear(cols(w(f"{attn}.o_proj.weight"), q_rows), dtype)
        if spec.qk_norm:
            self.q_norm = w(f"{attn}.q_norm.weight")
            self.k_norm = w(f"{attn}.k_norm.weight")
        lo, hi = shard_range(spec.intermediate_size, tp.rank, tp.size)
        self.gate_up_proj = make_linear(cat_rows([
            rows(w("mlp.gate_proj.weight"), slice(lo, hi)), rows(w("mlp.up_proj.weight"), slice(lo, hi)),
        ]), dtype)
        self.down_proj = make_linear(cols(w("mlp.down_proj.weight"), slice(lo, hi)), dtype)
        self.input_norm = w("input_layernorm.weight")
        self.post_attn_norm = w("post_attention_layernorm.weight")

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: the residual stream, still missing the previous layer's output `delta` (None for the
        first layer); both are added in place. Returns this layer's output, for the next to add.
        `scales`: an fp8 cache's (model/kv_dtype.py)."""
        eps = self.spec.rms_norm_eps
        h = add_rms_norm(x, delta, self.input_norm, eps)
        h = add_rms_norm(x, self._attention(h, positions, k_cache, v_cache, meta, scales), self.post_attn_norm, eps)
        return self.tp.all_reduce(self.down_proj(silu_mul(self.gate_up_proj(h))))

    def _attention(self, x, positions, k_cache, v_cache, meta, scales):
        d, num_tokens = self.spec.head_dim, x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.view(num_tokens, self.num_heads, d)  # [tokens, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, d)
        v = v.view(num_tokens, self.num_kv_heads, d)
        if self.spec.qk_norm:
            q = rms_norm(q, self.q_norm, self.spec.rms_norm_eps)
            k = rms_norm(k, self.k_norm, self.spec.rms_norm_eps)
        q, k = rope_write_kv(self.rope, positions, q, k, v, k_cache, v_cache, meta.slot_blocks,
                             meta.slot_offsets, scales)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, scales)
        return self.tp.all_reduce(self.o_proj(o.reshape(num_tokens, -1)))


class CausalLM:
    """Embeddings, decoder layers, final norm and this rank's slice of the LM head."""

    def __init__(self, spec: ModelSpec, tp: TPGroup, get: WeightGetter, dtype: torch.dtype):
        check_tp_size(tp.size, spec.num_heads, spec.num_kv_heads)
        self.spec, self.tp, self.dtype = spec, tp, dtype
        self.rope = RotaryEmbedding(spec.head_dim, spec.max_model_len, spec.rope_theta,
                                    dict(spec.rope_scaling) or None, dtype)
        embed = cast(get("model.embed_tokens.weight"), dtype)
        self.layers = [DecoderLayer(spec, tp, get, f"model.layers.{i}", dtype, self.rope)
                       for i in range(spec.num_layers)]
        self.norm = get("model.norm.weight").to(dtype)
        head = embed if spec.tie_word_embeddings else cast(get("lm_head.weight"), dtype)
        lo, hi = shard_range(spec.vocab_size, tp.rank, tp.size)
        per_rank = -(-spec.vocab_size // tp.size)  # padded so shards gather evenly
        self.lm_head = make_linear(pad_rows(rows(head, slice(lo, hi)), per_rank), dtype)
        shared = None
        if head is embed and isinstance(self.lm_head, Int8Linear) and per_rank == spec.vocab_size:
            shared = self.lm_head.row_codes  # one copy of a tied int8 table
        self.embed = Embedding(embed, dtype, shared)
        self.fused_decode = FusedDecode.build(self)  # None: every step layer by layer

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [tokens] -> hidden states [tokens, hidden] after the final norm.
        kv_caches: per layer (k, v), or (k, v, k_scales, v_scales) for fp8 (worker/kv_cache.py)."""
        x = self.embed(input_ids)
        if self.fused_decode is not None and self.fused_decode.takes(x, kv_caches, meta):
            return self.fused_decode(x, positions, kv_caches, meta)
        return self.run_layers(x, positions, kv_caches, meta)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                   meta: AttentionMetadata) -> torch.Tensor:
        """The decoder layers and the final norm, layer by layer from Python; x: the embeddings,
        updated in place (the residual stream)."""
        delta = None
        for layer, (k_cache, v_cache, *scales) in zip(self.layers, kv_caches):
            delta = layer(x, delta, positions, k_cache, v_cache, meta, tuple(scales) or None)
        return add_rms_norm(x, delta, self.norm, self.spec.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, hidden] -> float32 logits [rows, vocab] on rank 0, None elsewhere."""
        logits = self.tp.gather_to_first(self.lm_head(hidden))
        if logits is None:
            return None
        return logits[:, : self.spec.vocab_size].float()

    def weight_bytes(self, per_step: bool = False) -> int:
        """Bytes this rank's weights occupy, a tied table counted once; `per_step`: those a decode
        step reads (all but the embedding rows it does not look up)."""
        linears = [self.lm_head] + [getattr(layer, name) for layer in self.layers
                                    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
        norms = [self.norm] + [t for layer in self.layers for t in (layer.input_norm, layer.post_attn_norm)]
        embed = 0 if per_step else self.embed.nbytes()
        return sum(weight_bytes(lin) for lin in linears) + embed + sum(t.numel() * t.element_size() for t in norms)
