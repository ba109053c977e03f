"""chat_template_kwargs, filtered to what a chat template may read.

A request's ``chat_template_kwargs`` go to ``tokenizer.apply_chat_template``, whose own keyword
arguments (``tokenize``, ``truncation``, ``padding``, ``return_dict``, ...) change what it does,
not what the template renders. Only the variables the template actually reads get through (found
by parsing it with Jinja), and never one of those arguments; the rest are dropped and logged once.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import jinja2
import jinja2.meta

logger = logging.getLogger(__name__)

# apply_chat_template's own parameters: never from a client.
_RESERVED = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# Set by the server itself from request fields (continue_final_message), not by the client.
_SERVER_SET = frozenset({"continue_final_message"})
_logged: set[str] = set()


@functools.lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str]:
    """The undeclared variables of a Jinja template (what a caller can pass it)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()  # rendering will report the broken template


def template_variables_only(kwargs: dict[str, Any] | None, template: str | None) -> dict[str, Any]:
    if not kwargs:
        return {}
    readable = template_variables(template) if template else frozenset()
    kept = {k: v for k, v in kwargs.items()
            if k in _SERVER_SET or (k in readable and k not in _RESERVED)}
    for k in kwargs.keys() - kept.keys():
        if k not in _logged:
            _logged.add(k)
            logger.info("chat_template_kwargs: dropped %r (not a variable the template reads)", k)
    return kept
