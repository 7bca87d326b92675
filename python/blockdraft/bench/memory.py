"""A sequence's drafter memory, measured from its tensors and from the formula."""

from __future__ import annotations

import math
from typing import Any

import torch


def state_memory(prop: Any, st: Any) -> dict[str, Any]:
    """A state's drafter memory: measured from its tensors vs the formula.

    The formula: accumulator = window x ctx_slot_bytes (ctx_slot_bytes = k x H x elem); paged
    K/V = pages x page_size x (L x 2 x Hkv x D x elem), with pages <= ceil(ctx rows /
    page_size).
    """
    cfg = prop.drafter.config
    elem = torch.empty((), dtype=prop.dtype).element_size()
    acc_measured = int(st.acc.numel() * st.acc.element_size())
    k, v = prop.cache.k, prop.cache.v  # [layers, pages, page_size, kv_heads, head_dim] each
    page_bytes = int(k[:, 0].numel() * k.element_size() + v[:, 0].numel() * v.element_size())
    kv_measured = int(st.ctx.num_pages * page_bytes)
    rows = int(st.ctx_len)
    page = prop.page_size
    acc_formula = int(st.window) * prop.ctx_row_width * elem
    need_pages = math.ceil(rows / page)
    per_row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    kv_formula = need_pages * page * per_row
    return {
        "window": int(st.window),
        "ctx_rows": rows,
        "pages": int(st.ctx.num_pages),
        "pages_bound": need_pages,
        "acc_bytes": acc_measured,
        "acc_bytes_formula": acc_formula,
        "kv_bytes": kv_measured,
        "kv_bytes_formula": kv_formula,
        "kv_bytes_per_row": per_row,
        "total_bytes": acc_measured + kv_measured,
        "equal_to_formula": acc_measured == acc_formula and kv_measured == kv_formula,
        "pages_within_bound": int(st.ctx.num_pages) <= need_pages,
    }
