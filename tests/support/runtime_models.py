"""Random small Hugging Face targets of every family the runtime supports (fp32, eval),
with the features that change its math: GQA ratios, tied/untied heads, q/k/v biases, q/k
norms, head_dim != hidden/heads, rotary scalings, sliding windows."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 61


def _base(**kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict(
        hidden_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=72, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    out.update(kw)
    return out


# name -> (model class, config class, config fields)
CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, _base(head_dim=12)),
    "qwen3-odd": (Qwen3ForCausalLM, Qwen3Config, _base(hidden_size=37, num_attention_heads=3,
                                                       num_key_value_heads=1, head_dim=10,
                                                       intermediate_size=71)),
    "qwen3-mha-tied": (Qwen3ForCausalLM, Qwen3Config, _base(num_key_value_heads=4, head_dim=10,
                                                           tie_word_embeddings=True)),
    "qwen3-sliding": (Qwen3ForCausalLM, Qwen3Config, _base(
        head_dim=8, use_sliding_window=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention",
                                                   "sliding_attention"])),
    "llama-gqa3": (LlamaForCausalLM, LlamaConfig, _base(hidden_size=48, num_attention_heads=6,
                                                       num_key_value_heads=2)),
    "llama-mqa-bias": (LlamaForCausalLM, LlamaConfig, _base(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=1, attention_bias=True,
        mlp_bias=True)),
    "llama-llama3": (LlamaForCausalLM, LlamaConfig, _base(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear": (LlamaForCausalLM, LlamaConfig, _base(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5})),
    "llama-dynamic": (LlamaForCausalLM, LlamaConfig, _base(rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-yarn": (LlamaForCausalLM, LlamaConfig, _base(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2-bias-tied": (Qwen2ForCausalLM, Qwen2Config, _base(tie_word_embeddings=True)),
    "qwen2-sliding": (Qwen2ForCausalLM, Qwen2Config, _base(
        use_sliding_window=True, sliding_window=5, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    "mistral-sliding-gqa4": (MistralForCausalLM, MistralConfig, _base(
        hidden_size=32, num_attention_heads=8, num_key_value_heads=2, head_dim=6,
        sliding_window=7)),
}


# Out of CASES, which every runtime test runs: a Llama with attention and MLP biases whose head
# counts 2 divides, for the tensor-parallel tests' row-parallel o/down biases.
TP_CASES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama-bias-gqa": (LlamaForCausalLM, LlamaConfig, _base(attention_bias=True, mlp_bias=True)),
}


def make_target(name: str, seed: int = 0) -> Any:
    """The model of ``CASES`` or ``TP_CASES`` named ``name``, its biases drawn too."""
    model_cls, config_cls, fields = {**CASES, **TP_CASES}[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    # Biases start at zero in HF's init: make them count.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def hf_greedy(model: Any, prompt: list[int], n: int, stops: list[int] | None = None) -> list[int]:
    """The model's own greedy continuation, cut after the first stop token. (The attention
    mask is given: ``generate`` would otherwise mask every prompt token equal to the pad id.)"""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    tokens: list[int] = list(out)
    if stops:
        for i, t in enumerate(tokens):
            if t in stops:
                return tokens[: i + 1]
    return tokens
