"""Drafter torch modules: DFlash / DFlash2 layers, RoPE, and the reference attention."""

from __future__ import annotations

from blockdraft.models.attention import ReferenceAttend, attention_reference, visibility_mask
from blockdraft.models.drafter import AttendFn, DecoderLayer, DFlash2Drafter, DFlashDrafter, Draft, LmHead
from blockdraft.models.layers import CandidateSelector, GroupedDynamicConv, grouped_dynamic_conv, rms_norm
from blockdraft.models.rope import Rope, apply_rope, rope_frequencies, rotate_half

__all__ = [
    "AttendFn",
    "CandidateSelector",
    "DFlash2Drafter",
    "DFlashDrafter",
    "DecoderLayer",
    "Draft",
    "GroupedDynamicConv",
    "LmHead",
    "ReferenceAttend",
    "Rope",
    "apply_rope",
    "attention_reference",
    "grouped_dynamic_conv",
    "rms_norm",
    "rope_frequencies",
    "rotate_half",
    "visibility_mask",
]
