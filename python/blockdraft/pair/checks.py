"""Whether a drafter fits a target, and whether a prompt and its new tokens fit a context.

Each check has one message; callers raise it as their own error type (``ConfigError``,
``ValueError``, a one-line CLI error, an HTTP 400).
"""

from __future__ import annotations

from collections.abc import Sequence

from blockdraft._core import ConfigError


def check_fits(
    *,
    drafter_hidden: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int | None,
    target_hidden: int,
    target_layers: int | None,
    embed_rows: int,
    config_hidden: int | None = None,
    selector_rows: int | None = None,
    head_rows: int | None = None,
) -> None:
    """Raise :class:`ConfigError` unless a drafter can run on a target.

    Args:
        drafter_hidden / target_layer_ids / mask_token_id: the drafter's hidden size, the
            target layers it reads and its mask token (``None``: none).
        target_hidden: the width of the target's embedding rows; ``config_hidden`` the
            target config's ``hidden_size`` when known (both must match the drafter's).
        target_layers: the target's layer count when known.
        embed_rows / head_rows: rows of the target's input embeddings and of its LM head.
        selector_rows: a DFlash2 drafter's codebook rows (its ``vocab_size``), else ``None``.
    """
    for width in (target_hidden, config_hidden):
        if width is not None and width != drafter_hidden:
            raise ConfigError(f"drafter hidden_size {drafter_hidden} != target hidden_size {width} "
                              "(the drafter reads target hidden states of its own hidden size)")
    bad = [i for i in target_layer_ids if target_layers is not None and not 0 <= i < target_layers]
    if bad:
        raise ConfigError(f"target layer id {bad[0]} is out of range: the target has {target_layers} "
                          f"layers (drafter target_layer_ids {list(target_layer_ids)})")
    if mask_token_id is not None and not 0 <= mask_token_id < embed_rows:
        raise ConfigError(f"drafter mask_token_id {mask_token_id} is outside the target's embedding "
                          f"table ({embed_rows} rows)")
    if selector_rows is not None and head_rows is not None and selector_rows < head_rows:
        raise ConfigError(f"DFlash2 selector codebooks have {selector_rows} rows but the target head "
                          f"has {head_rows} tokens")


def context_problem(
    prompt_tokens: int,
    max_new_tokens: int | None,
    limit: int | None,
    *,
    limit_name: str = "max_seq_len",
    new_name: str = "max_new_tokens",
    prompt: str = "the prompt",
) -> str | None:
    """Why ``prompt_tokens`` and ``max_new_tokens`` new tokens do not fit ``limit`` positions,
    or ``None`` when they fit (or ``limit`` is unknown).

    ``limit_name`` names the limit (``max_seq_len``, ``the target's max_position_embeddings``),
    ``new_name`` the count of new tokens (``--max-new-tokens``, ``max_tokens``) and ``prompt``
    the prompt (``prompt 2``). ``max_new_tokens=None`` checks only that one new token fits.
    """
    if limit is None:
        return None
    if prompt_tokens >= limit:
        return (f"{prompt} is {prompt_tokens} tokens; {limit_name} is {limit}, which must hold "
                "the prompt and at least one new token")
    room = limit - prompt_tokens
    if max_new_tokens is not None and max_new_tokens > room:
        return (f"{new_name} {max_new_tokens} does not fit: {limit_name} is {limit} and {prompt} "
                f"takes {prompt_tokens} tokens (at most {room})")
    return None


def check_context(prompt_tokens: int, max_new_tokens: int | None, limit: int | None, *,
                  limit_name: str = "max_seq_len", new_name: str = "max_new_tokens",
                  prompt: str = "the prompt") -> None:
    """Raise ``ValueError`` with :func:`context_problem`'s message when the tokens do not fit."""
    problem = context_problem(prompt_tokens, max_new_tokens, limit, limit_name=limit_name,
                              new_name=new_name, prompt=prompt)
    if problem is not None:
        raise ValueError(problem)
