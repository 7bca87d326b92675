"""Adapter around a Hugging Face causal LM target (any ``AutoModelForCausalLM`` whose hidden
states ``output_hidden_states`` exposes: Qwen3, Llama, GPT-2, GPT-NeoX, Phi, Gemma, ...).

It gives the drafter the target's input embeddings and output head, and captures the hidden
states of the layers in ``target_layer_ids``, written straight into the ctx row layout the
proposer stores: ``[rows, k*H]``, layers in config order, rows in (sequence, token) order.
Layer id ``i`` is the output of decoder layer ``i``, i.e. Hugging Face's
``hidden_states[i + 1]``; like Hugging Face, the last layer's entry is the decoder's
``last_hidden_state``, taken after the final norm (training reads ``hidden_states`` and so
sees it that way).

Two ways to capture, chosen once (:attr:`TargetAdapter.capture`):

* ``"hooks"``: where :func:`~blockdraft.target.layers.find_layers` finds the decoder layers,
  forward hooks on the layers read (and on the decoder, for the last layer) write the rows
  during the forward; nothing else is kept.
* ``"hidden_states"``: otherwise, each forward asks for ``output_hidden_states=True`` and the
  rows are copied out of ``hidden_states[i + 1]`` (every layer's states live until the copy).
  A model whose forward gives no hidden states either is refused at construction.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from blockdraft._core import ConfigError
from blockdraft.config import DrafterConfig
from blockdraft.errors import error_line
from blockdraft.pair.checks import check_fits
from blockdraft.target.layers import LAYER_LIST_NAMES, config_int, find_layers

logger = logging.getLogger(__name__)

Capture = Literal["hooks", "hidden_states"]


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        logits: [n, T, V] (or the last ``logits_to_keep`` positions).
        ctx_rows: [n*T, k*H] captured hidden states of the target layers.
        past_key_values: the (updated) cache, when one was used.
    """

    logits: Tensor
    ctx_rows: Tensor
    past_key_values: Any


def _input_embeddings(model: nn.Module, decoder: nn.Module | None) -> object:
    """``get_input_embeddings()`` of the model, else of its decoder (a module wrapping a causal
    LM), else the decoder's ``embed_tokens``."""
    for owner in (model, decoder):
        get_in = getattr(owner, "get_input_embeddings", None)
        if callable(get_in):
            return get_in()
    return getattr(decoder, "embed_tokens", None)


def _output_head(model: nn.Module) -> object:
    """``model.lm_head``, ``model.get_output_embeddings()``, or the ``lm_head`` of a wrapped
    model."""
    head = getattr(model, "lm_head", None)
    if head is None:
        get_out = getattr(model, "get_output_embeddings", None)
        head = get_out() if callable(get_out) else None
    if head is None:
        head = next((m for name, m in model.named_modules() if name.endswith("lm_head")), None)
    return head


def _names_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward names a ``logits_to_keep`` parameter (Hugging Face causal
    LMs do): then a forward can ask for the last rows' logits only."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("logits_to_keep")
    return p is not None and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def _hidden_state_count(model: nn.Module, device: torch.device) -> int:
    """Decoder layers of ``model`` by its own ``output_hidden_states`` (a two-token forward);
    raises ``ConfigError`` naming why the model gives none."""
    name = type(model).__name__
    not_found = (f"target {name}: its decoder layers were not found (no get_decoder() or base_model "
                 f"holding a list named {'/'.join(LAYER_LIST_NAMES)} or an nn.ModuleList of "
                 "num_hidden_layers blocks)")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.zeros(1, 2, dtype=torch.int64, device=device), output_hidden_states=True)
    except Exception as exc:  # noqa: BLE001 - any failure means no hidden states; named below
        raise ConfigError(f"{not_found}, and its forward with output_hidden_states=True failed: "
                          f"{error_line(exc)}") from exc
    states = getattr(out, "hidden_states", None)
    if (not isinstance(states, (tuple, list)) or len(states) < 2
            or not all(isinstance(h, Tensor) and h.dim() == 3 and h.shape[:2] == (1, 2) for h in states)):
        raise ConfigError(f"{not_found}, and its forward returns no hidden_states with "
                          "output_hidden_states=True: the drafter has no target hidden states to read")
    return len(states) - 1


def _layer_output(output: Any) -> Any:
    """The hidden states a layer or decoder returned: a tensor, a tuple's first element, or
    a Hugging Face output's ``last_hidden_state``."""
    last = getattr(output, "last_hidden_state", None)
    if last is not None:
        return last
    return output[0] if isinstance(output, (tuple, list)) else output


class TargetAdapter:
    """Wraps ``model`` (an ``AutoModelForCausalLM``) for a drafter described by ``config``.

    Args:
        model: the target; its weights are used in place (nothing is copied).
        config: the drafter's config, or just the target layer ids to capture.

    Raises:
        ConfigError: the drafter does not fit the target (hidden size, layer ids, vocabulary),
            or the target gives no hidden states (no decoder layers found, and nothing from
            ``output_hidden_states``), named in the message.
    """

    def __init__(self, model: nn.Module, config: DrafterConfig | Sequence[int]) -> None:
        self.model = model
        found = find_layers(model)
        embed = _input_embeddings(model, found.decoder if found is not None else None)
        if not isinstance(embed, nn.Module) or not isinstance(getattr(embed, "weight", None), Tensor):
            raise ConfigError(f"target {type(model).__name__} has no input embedding table")
        embedding_weight = embed.weight
        assert isinstance(embedding_weight, Tensor)
        self.embedding_weight: Tensor = embedding_weight
        head = _output_head(model)
        if not isinstance(head, nn.Module) or not isinstance(getattr(head, "weight", None), Tensor):
            raise ConfigError(f"target {type(model).__name__} has no output head (lm_head)")
        self.head: nn.Module = head
        self.hidden_size = config_int(model, "hidden_size") or int(self.embedding_weight.shape[1])
        self.takes_logits_to_keep = _names_logits_to_keep(model)
        """Whether the model's forward takes ``logits_to_keep`` (else every row's logits are
        computed and the last ones copied out)."""
        self.vocab_size = int(self.lm_head.shape[0])
        self.decoder: nn.Module | None = found.decoder if found is not None else None
        """The decoder module whose output is the last hidden state (``None``: not found)."""
        self.capture: Capture = "hooks" if found is not None else "hidden_states"
        """How the rows are taken: forward hooks on the layers, or the model's own
        ``output_hidden_states``."""
        self.num_layers = len(found.layers) if found is not None else _hidden_state_count(model, self.device)

        if isinstance(config, DrafterConfig):
            self.layer_ids = tuple(config.target_layer_ids)
            self._check_fit(config)
        else:
            self.layer_ids = tuple(int(i) for i in config)
        if not self.layer_ids:
            raise ConfigError("target_layer_ids is empty")
        for i in self.layer_ids:
            if not 0 <= i < self.num_layers:
                raise ConfigError(
                    f"target layer id {i} is out of range: the target has {self.num_layers} layers"
                )
        self._sink: Tensor | None = None
        self._seen: list[bool] = []
        self._handles: list[RemovableHandle] = []
        self._closed = False
        if found is not None:
            for slot, layer_id in enumerate(self.layer_ids):
                # Hugging Face's last hidden_states entry is the decoder's output, after the final
                # norm: take the last layer there.
                last = layer_id == self.num_layers - 1
                module = found.decoder if last else found.layers[layer_id]
                self._handles.append(module.register_forward_hook(self._make_hook(slot)))
        logger.info("target %s: %d decoder layers; rows of layers %s %s", type(model).__name__,
                    self.num_layers, list(self.layer_ids),
                    f"hooked at {found.where}" if found is not None else "read from output_hidden_states")

    def _check_fit(self, config: DrafterConfig) -> None:
        check_fits(drafter_hidden=config.hidden_size, target_layer_ids=config.target_layer_ids,
                   mask_token_id=config.mask_token_id, target_hidden=self.hidden_size,
                   target_layers=self.num_layers, embed_rows=int(self.embedding_weight.shape[0]),
                   selector_rows=config.vocab_size if config.is_dflash2 else None,
                   head_rows=self.vocab_size)
        if config.num_target_layers is not None and config.num_target_layers != self.num_layers:
            logger.warning(
                "drafter was made for a %d-layer target; this target has %d layers",
                config.num_target_layers, self.num_layers,
            )
        if self.embedding_weight.shape[0] != self.vocab_size:
            logger.info(
                "target embedding rows (%d) != lm_head rows (%d)", self.embedding_weight.shape[0], self.vocab_size
            )

    def _make_hook(self, slot: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            sink = self._sink
            if sink is None:
                return
            hidden = _layer_output(output)
            n, t, h = hidden.shape
            sink.view(n, t, len(self.layer_ids), h)[:, :, slot, :].copy_(hidden)
            self._seen[slot] = True

        return hook

    def _copy_states(self, states: Any, sink: Tensor) -> None:
        """The ``"hidden_states"`` capture: ``states[i + 1]`` of each layer id into ``sink``."""
        if not isinstance(states, (tuple, list)) or len(states) != self.num_layers + 1:
            got = len(states) if isinstance(states, (tuple, list)) else type(states).__name__
            raise RuntimeError(f"the target returned {got} hidden_states entries, not {self.num_layers + 1}")
        for slot, layer_id in enumerate(self.layer_ids):
            hidden = states[layer_id + 1]
            n, t, h = hidden.shape
            sink.view(n, t, len(self.layer_ids), h)[:, :, slot, :].copy_(hidden)
            self._seen[slot] = True

    @property
    def lm_head(self) -> Tensor:
        """[V, H] output head weight."""
        weight = self.head.weight
        assert isinstance(weight, Tensor)
        return weight

    @property
    def embed_weight(self) -> Tensor:
        """[V_in, H] input embedding table (the name the proposer looks for)."""
        return self.embedding_weight

    @property
    def config(self) -> Any:
        """The wrapped model's config (layer count and hidden size checks)."""
        return getattr(self.model, "config", None)

    @property
    def device(self) -> torch.device:
        """The device of the target's input embeddings."""
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the target's input embeddings."""
        return self.embedding_weight.dtype

    @property
    def ctx_row_size(self) -> int:
        """k*H values per ctx row."""
        return len(self.layer_ids) * self.hidden_size

    def embed(self, tokens: Tensor) -> Tensor:
        """Raw embedding rows: [...] int64 -> [..., H] (no model-specific scaling)."""
        return F.embedding(tokens.to(self.device), self.embedding_weight)

    def new_cache(self) -> Any:
        """An empty ``DynamicCache`` for incremental forwards."""
        from transformers import DynamicCache

        cache = DynamicCache(config=getattr(self.model, "config", None))
        # Sliding-window layers must keep rows past their window until a crop, so a rejected
        # block can be rolled back.
        cache.activate_past_recording()  # type: ignore[no-untyped-call]
        return cache

    @staticmethod
    def crop_cache(cache: Any, length: int) -> None:
        """Drop cached positions ``>= length`` (rejected drafts)."""
        remove = int(cache.get_seq_length()) - length
        if remove > 0:
            cache.crop(-remove)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        past_key_values: Any = None,
        *,
        out: Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> TargetOutput:
        """Run the target on ``input_ids`` [n, T] and capture the ctx rows.

        Args:
            positions: [n, T] int64 absolute positions (default: continue the cache).
            past_key_values: a cache from :meth:`new_cache` (updated in place), or ``None``.
            out: [n*T, k*H] where to write the ctx rows (e.g. a view of the proposer's
                accumulator; any dtype, cast on write); allocated when ``None``.
            logits_to_keep: 0 = logits for every position, else only the last ones.
        """
        n, t = input_ids.shape
        rows = n * t
        if out is None:
            out = torch.empty(rows, self.ctx_row_size, dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != (rows, self.ctx_row_size) or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous [{rows}, {self.ctx_row_size}] tensor, got {list(out.shape)}"
            )
        kwargs: dict[str, Any] = {}
        if positions is not None:
            kwargs["position_ids"] = positions.to(self.device)
        if logits_to_keep and self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        from_states = self.capture == "hidden_states" and not self._closed
        if from_states:
            kwargs["output_hidden_states"] = True
        self._sink = out
        self._seen = [False] * len(self.layer_ids)
        try:
            result = self.model(
                input_ids=input_ids.to(self.device),
                past_key_values=past_key_values,
                use_cache=past_key_values is not None,
                **kwargs,
            )
        finally:
            self._sink = None
        if from_states:
            self._copy_states(result.hidden_states, out)
        if not all(self._seen):
            missing = [i for i, seen in zip(self.layer_ids, self._seen) if not seen]
            raise RuntimeError(f"target layers {missing} did not run; cannot capture their hidden states")
        logits = result.logits
        if logits_to_keep and "logits_to_keep" not in kwargs:
            # Every row was computed: copy the kept ones out so the rest can be freed (a slice
            # would keep the whole [n, T, V] storage alive).
            logits = logits[:, -logits_to_keep:].clone()
        return TargetOutput(logits=logits, ctx_rows=out, past_key_values=past_key_values)

    def close(self) -> None:
        """Remove the hooks (the adapter cannot capture afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._closed = True
