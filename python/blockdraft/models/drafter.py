"""DFlash and DFlash2 drafters in plain torch (the reference for every faster path).

The drafter owns no embedding table and no LM head: block rows are the target's embeddings and
its output rows go through the target's ``lm_head``. Context rows (k target layers' hidden
states concatenated, ``[R, k*H]``) are fused by ``fc`` + ``hidden_norm``; in every layer they
supply extra keys/values (``k_norm(k_proj(fused))`` roped at their positions, ``v_proj(fused)``)
in front of the block's own. Queries come from the block rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockdraft.config import DrafterConfig
from blockdraft.models.attention import ReferenceAttend
from blockdraft.models.layers import MLP, CandidateSelector, Device, GroupedDynamicConv, RMSNorm, rms_norm
from blockdraft.models.rope import Rope, apply_rope
from blockdraft.sampling import sample_rows

AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""``attend(layer, q [n,B,Hq,D], k [n,B,Hkv,D], v [n,B,Hkv,D]) -> [n,B,Hq,D]``."""

LmHead = Tensor | Callable[[Tensor], Tensor]
"""The target's output head: its weight [V, H] or a module mapping [..., H] to [..., V]."""


class SelfAttention(nn.Module):
    def __init__(self, config: DrafterConfig, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        h, hq, hkv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, hq * d, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(h, hkv * d, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(h, hkv * d, bias=bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(hq * d, h, bias=bias, device=device, dtype=dtype)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, device=device, dtype=dtype)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DrafterConfig, *, device: Device = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, device=device, dtype=dtype)
        self.self_attn = SelfAttention(config, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, device=device, dtype=dtype)
        self.mlp = MLP(h, config.intermediate_size, device=device, dtype=dtype)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if config.is_dflash2:
            assert config.conv_kernel_size is not None and config.conv_group_size is not None
            k, g = config.conv_kernel_size, config.conv_group_size
            self.attention_conv = GroupedDynamicConv(h, k, g, device=device, dtype=dtype)
            self.mlp_conv = GroupedDynamicConv(h, k, g, device=device, dtype=dtype)


@dataclass
class Draft:
    """Result of :meth:`DFlashDrafter.draft` for rows 1..B-1 of ``n`` blocks.

    Attributes:
        tokens: [n, T] drafted tokens.
        logits: [n, T, V] logits after the output transforms.
        q: [n, T, V] (DFlash) or [n, T, K] (DFlash2) fp32 draft distribution; ``None`` if greedy.
        candidates: [n, T, K] DFlash2 candidate ids (``q`` is over them); ``None`` for DFlash.
    """

    tokens: Tensor
    logits: Tensor
    q: Tensor | None = None
    candidates: Tensor | None = None


class DFlashDrafter(nn.Module):
    """A DFlash drafter (``architectures: ["DFlashDraftModel"]``).

    Build it with :func:`blockdraft.load_drafter`; the constructor makes uninitialised
    parameters of the right shapes (on ``device``, ``meta`` for a loader).
    """

    def __init__(
        self, config: DrafterConfig, *, device: Device = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * h, h, bias=False, device=device, dtype=dtype)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, device=device, dtype=dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, device=device, dtype=dtype)
        self.rope = Rope.from_config(config, device)

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer ``i`` (typed access to ``layers[i]``)."""
        layer = self.layers[i]
        assert isinstance(layer, DecoderLayer)
        return layer

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> DFlashDrafter:
        # Keep the RoPE frequencies (not a parameter; always fp32) on the weights' device.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.rope = self.rope.to(self.fc.weight.device)
        return self

    def fuse_context(self, ctx_rows: Tensor) -> Tensor:
        """``hidden_norm(fc(ctx_rows))``: [R, k*H] -> [R, H] (any leading dims)."""
        fused: Tensor = self.fc(ctx_rows.to(self.fc.weight.dtype))
        return rms_norm(fused, self.hidden_norm.weight, self.hidden_norm.eps)

    def ctx_kv_weight(self) -> Tensor:
        """[L*2*Hkv*D, H]: every layer's ``k_proj`` then ``v_proj`` weight, stacked layer-major."""
        parts: list[Tensor] = []
        for i in range(self.config.num_layers):
            attn = self.layer(i).self_attn
            parts += [attn.k_proj.weight, attn.v_proj.weight]
        return torch.cat(parts, dim=0)

    def ctx_kv_bias(self) -> Tensor | None:
        """[L*2*Hkv*D] biases in :meth:`ctx_kv_weight`'s row order, or ``None`` without bias."""
        if not self.config.attention_bias:
            return None
        parts: list[Tensor] = []
        for i in range(self.config.num_layers):
            attn = self.layer(i).self_attn
            assert attn.k_proj.bias is not None and attn.v_proj.bias is not None
            parts += [attn.k_proj.bias, attn.v_proj.bias]
        return torch.cat(parts, dim=0)

    def k_norm_weights(self) -> Tensor:
        """[L, D]: every layer's ``k_norm`` weight."""
        return torch.stack([self.layer(i).self_attn.k_norm.weight for i in range(self.config.num_layers)])

    def context_kv(self, fused: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer ``(K, V)`` of ctx rows: ``fused`` [R, H], ``positions`` [R] -> each [R, Hkv, D].

        K is ``k_norm(k_proj(fused))`` roped at ``positions``; V is ``v_proj(fused)``.
        """
        c = self.config
        r = fused.shape[0]
        cos, sin = self.rope.cos_sin(positions, fused.dtype)
        out: list[tuple[Tensor, Tensor]] = []
        for i in range(c.num_layers):
            attn = self.layer(i).self_attn
            k: Tensor = attn.k_proj(fused)
            v: Tensor = attn.v_proj(fused)
            k = attn.k_norm(k.reshape(r, c.num_kv_heads, c.head_dim))
            out.append((apply_rope(k, cos, sin), v.reshape(r, c.num_kv_heads, c.head_dim)))
        return out

    def forward_block(
        self, embeds: Tensor, positions: Tensor, attend: AttendFn, segment: int | None = None
    ) -> Tensor:
        """Run the drafter layers over ``n`` blocks.

        Args:
            embeds: [n, B, H] the target's raw input embeddings of the block tokens; this method
                applies ``input_embedding_scale``.
            positions: [n, B] int64 absolute positions of the block rows.
            attend: see :data:`AttendFn`; it adds the context K/V of each sequence.
            segment: DFlash2 only: the B rows are B / segment blocks placed one after another
                (the training forward); the convolutions stay inside each. ``None``: one block.
        Returns:
            [n, B, H] hidden rows after the final norm.
        """
        c = self.config
        n, b = embeds.shape[:2]
        h = embeds.to(self.dtype)
        if c.input_embedding_scale != 1.0:  # x * 1.0 == x: skip a pass over the rows
            h = h * c.input_embedding_scale
        cos, sin = self.rope.cos_sin(positions, h.dtype)
        for i in range(c.num_layers):
            layer = self.layer(i)
            attn = layer.self_attn
            residual = h
            x: Tensor = layer.input_layernorm(h)
            attn_taps = None
            if layer.attention_conv is not None:
                x, attn_taps = layer.attention_conv.prepare(x, segment)
            q: Tensor = attn.q_norm(attn.q_proj(x).reshape(n, b, c.num_heads, c.head_dim))
            k: Tensor = attn.k_norm(attn.k_proj(x).reshape(n, b, c.num_kv_heads, c.head_dim))
            v: Tensor = attn.v_proj(x).reshape(n, b, c.num_kv_heads, c.head_dim)
            o = attend(i, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
            y: Tensor = attn.o_proj(o.reshape(n, b, c.num_heads * c.head_dim))
            if layer.attention_conv is not None and attn_taps is not None:
                y = layer.attention_conv.finish(y, attn_taps, segment)
            h = residual + y
            residual = h
            x = layer.post_attention_layernorm(h)
            mlp_taps = None
            if layer.mlp_conv is not None:
                x, mlp_taps = layer.mlp_conv.prepare(x, segment)
            y = layer.mlp(x)
            if layer.mlp_conv is not None and mlp_taps is not None:
                y = layer.mlp_conv.finish(y, mlp_taps, segment)
            h = residual + y
        out: Tensor = self.norm(h)
        return out

    def logits(self, hidden: Tensor, lm_head: LmHead) -> Tensor:
        """[..., H] -> [..., V]: the target head, then ``output_multiplier`` and softcapping."""
        if isinstance(lm_head, Tensor):
            # One [rows, H] matrix: on a strided 3-D input (rows 1..B-1 of [n, B, H]) linear
            # runs a batched GEMM that reads the whole [V, H] head once per leading index.
            flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.dtype)
            logits = F.linear(flat, lm_head).view(*hidden.shape[:-1], lm_head.shape[0])
        else:
            logits = lm_head(hidden)
        if self.config.output_multiplier != 1.0:  # x * 1.0 == x: skip a pass over [.., V]
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def draft(
        self,
        hidden: Tensor,
        anchor: Tensor,
        lm_head: LmHead,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Draft:
        """Tokens for block rows 1..B-1.

        Args:
            hidden: [n, T, H] output rows 1..B-1 of :meth:`forward_block`.
            anchor: [n] the block's anchor token (used by DFlash2's selector).
            temperature: 0 = argmax; > 0 samples from ``softmax(logits / temperature)``.
        """
        logits = self.logits(hidden, lm_head)
        if temperature <= 0:
            return Draft(tokens=torch.argmax(logits, dim=-1), logits=logits)
        q = torch.softmax(logits.to(torch.float32) / temperature, dim=-1)
        flat = sample_rows(q.reshape(-1, q.shape[-1]), generator)
        return Draft(tokens=flat.reshape(q.shape[:-1]), logits=logits, q=q)

    def reference_forward(
        self,
        ctx_rows: Tensor,
        ctx_positions: Tensor,
        block_embeds: Tensor,
        block_positions: Tensor,
    ) -> Tensor:
        """One sequence through the reference path.

        Args:
            ctx_rows: [R, k*H] target hidden states (layer order of ``target_layer_ids``).
            ctx_positions: [R] int64.
            block_embeds: [B, H] raw target embeddings of ``[anchor, MASK, ...]``.
            block_positions: [B] int64.
        Returns:
            [B, H] hidden rows after the final norm.
        """
        kv = self.context_kv(self.fuse_context(ctx_rows), ctx_positions)
        attend = ReferenceAttend(self.config, [kv], [ctx_positions], block_positions[None])
        return self.forward_block(block_embeds[None], block_positions[None], attend)[0]


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter (``architectures: ["DFlash2DraftModel"]``): per-layer dynamic causal
    convolutions around attention and MLP, and a candidate selector over top-K logits."""

    def __init__(
        self, config: DrafterConfig, *, device: Device = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(config, device=device, dtype=dtype)
        assert config.selector_rank is not None and config.selector_top_k is not None
        self.candidate_selector = CandidateSelector(
            config.hidden_size,
            config.vocab_size,
            config.selector_rank,
            config.selector_top_k,
            device=device,
            dtype=dtype,
        )

    def draft(
        self,
        hidden: Tensor,
        anchor: Tensor,
        lm_head: LmHead,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Draft:
        """Selector walk over the top-K candidates of each row (see :class:`CandidateSelector`)."""
        logits = self.logits(hidden, lm_head)
        tokens, candidates, q = self.candidate_selector.select(
            hidden, logits, anchor, temperature, generator
        )
        return Draft(tokens=tokens, logits=logits, q=q, candidates=candidates)
