"""A model's chat template, rendered the way transformers renders it.

jinja2 in a sandbox with ``trim_blocks``/``lstrip_blocks`` and the loop-controls extension, the
``tojson`` filter without ASCII escaping, the ``raise_exception`` and ``strftime_now`` globals,
and ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None unless given) in
the context; the tokenizer adds its special tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """A template that does not compile or render, or that rejected the messages."""


class ChatTemplate:
    """One compiled chat template; ``source`` (its file) names it in errors."""

    def __init__(self, template: str, source: str = "<in code>") -> None:
        self.source = source
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{source}: chat template has a syntax error: {e}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **context: Any,
    ) -> str:
        """The prompt text for ``messages`` ([{"role": ..., "content": ...}])."""
        context = {"tools": None, "documents": None, **context}
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: chat template failed to render: {e}") from None


class _TemplateRaised(Exception):
    """What a template's ``raise_exception(message)`` raises."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys=False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
