"""Chat messages to prompt tokens.

A tokenizer with a chat template renders the messages with it (generation prompt added). The
built-in pair's tokenizer has none: it is a Python-code model that continues text, so its
minimal template is "continue the last user message as code". Any other model without a
template cannot chat; the server says so (400) instead of guessing a format the model never
saw.
"""

from __future__ import annotations

from typing import Any

from blockdraft.serve.errors import invalid


class ChatFormat:
    """How one model's chat messages become prompt token ids.

    Args:
        tokenizer: the model's tokenizer (``encode``; ``apply_chat_template`` when it has a
            ``chat_template``).
        builtin: the tokenizer is the built-in pair's (the code-continuation template).
    """

    def __init__(self, tokenizer: Any, *, builtin: bool) -> None:
        self.tokenizer = tokenizer
        self.builtin = builtin
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids for ``messages`` (each ``{"role", "content"}``).

        Raises:
            APIError: 400 when the model has no chat format, or the built-in format finds no
                user message.
        """
        if self.has_template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
            return list(self.tokenizer.encode(str(text), add_special_tokens=False))
        if not self.builtin:
            raise invalid("this model's tokenizer has no chat template, so chat completions are "
                          "not available; use /v1/completions with a prompt", "messages",
                          code="no_chat_template")
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise invalid("the built-in model continues the last user message as code: "
                          "messages must hold a user message", "messages")
        return list(self.tokenizer.encode(users[-1]))


__all__ = ["ChatFormat"]
