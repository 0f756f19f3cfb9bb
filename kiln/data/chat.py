"""Chat templates: a conversation rendered to the text a chat model was trained on, as transformers'
`apply_chat_template` renders it (checked against it in tests/data/test_chat.py).

    template = chat_template(DIR)       a model directory's template: chat_template.jinja, else tokenizer_config.json's
                                        "chat_template" (a string, or named templates: "default"); None if it has none
    tokens = special_tokens(DIR)        {"bos_token": "<s>", "eos_token": ...}: the names a template may use
    text = render(messages, template, tokens, add_generation_prompt=True)
    text, spans = render_spans(messages, template, tokens)   and the character spans of its {% generation %} blocks
    check_messages(messages, where)     a conversation's shape, or one ValueError naming `where`

The environment is transformers': Jinja's sandbox (templates come from the Hub: untrusted code), trim_blocks and
lstrip_blocks, the loop controls ({% break %}, {% continue %}), a `tojson` that keeps non-ASCII characters and
does not escape HTML, `raise_exception(message)`, `strftime_now(format)`, and `{% generation %}` blocks rendered
as their content. Each message loses its keys whose value is null, and a message with reasoning under any of
its names (reasoning_content, thinking, reasoning) gets it under the first two as well, as transformers does.
Encoding the text: the tokenizer's encode_chat, where the template's special tokens (<|im_start|>) are their ids.
"""
from __future__ import annotations

import json
import re
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")
_TRACKING = threading.local()  # render_spans' (output blocks so far, spans found) while it renders


class TemplateError(ValueError):
    """A template that does not parse, or that refuses the conversation (its raise_exception)."""


def chat_template(directory: str | Path, name: str = "default") -> str | None:
    """The chat template saved with a tokenizer in `directory`, or None."""
    directory = Path(directory)
    if name != "default" and (directory / "additional_chat_templates" / f"{name}.jinja").is_file():
        return (directory / "additional_chat_templates" / f"{name}.jinja").read_text()
    if name == "default" and (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = _config(directory).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get(name)
    return template if isinstance(template, str) else None


def special_tokens(directory: str | Path) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json (else special_tokens_map.json) as strings."""
    directory = Path(directory)
    found = {}
    for source in (_config(directory), _read(directory / "special_tokens_map.json")):
        for key in SPECIAL_TOKENS:
            value = source.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str) and key not in found:
                found[key] = value
    return found


def check_messages(messages, where: str) -> list[dict]:
    """`messages` as a conversation: a non-empty list of objects with a string "role"; else one ValueError."""
    if not isinstance(messages, list) or not messages:
        raise KilnError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}}",
                        key=where, value=messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise KilnError(f"{where}: message {i} must be an object with a string \"role\" (and its \"content\")",
                            key=where, value=m)
    return messages


def render(messages: list[dict], template: str, tokens: dict[str, str] | None = None,
           add_generation_prompt: bool = True, **variables) -> str:
    """The conversation as the template writes it; add_generation_prompt ends it with the assistant's header.
    `variables` reach the template as transformers' apply_chat_template(**kwargs) do (e.g. enable_thinking)."""
    return "".join(_generate(messages, template, tokens, add_generation_prompt, variables))


def render_spans(messages: list[dict], template: str, tokens: dict[str, str] | None = None,
                 add_generation_prompt: bool = False, **variables) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character spans of its {% generation %} blocks, found as
    transformers' return_assistant_tokens_mask finds them: a block starts at the length of the output so far."""
    blocks, spans = [], []
    _TRACKING.active = (blocks, spans)
    try:
        for block in _generate(messages, template, tokens, add_generation_prompt, variables):
            blocks.append(block)
    finally:
        _TRACKING.active = None
    return "".join(blocks), spans


def has_generation(template: str) -> bool:
    """Whether the template marks the assistant's text with {% generation %} blocks."""
    return re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def _generate(messages, template, tokens, add_generation_prompt, variables):
    chat = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    try:
        # generate(): the output a block at a time, so render_spans sees where each {% generation %} block begins
        yield from _compiled(template).generate(messages=chat, tools=None, documents=None,
                                                add_generation_prompt=add_generation_prompt,
                                                **{**(tokens or {}), **variables})
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template: {e.message or type(e).__name__}") from None


class _Generation(Extension):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's tokens with it; rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        out = caller()
        active = getattr(_TRACKING, "active", None)
        if active is not None:
            start = sum(len(b) for b in active[0])
            active[1].append((start, start + len(out)))
        return out


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not parse: {e.message} (template line {e.lineno})") from None


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KilnError(f"{path} is not valid JSON; restore it from the model's source", key=str(path),
                        fix="restore it from the model's source") from None
    return data if isinstance(data, dict) else {}


def _config(directory: Path) -> dict:
    return _read(directory / "tokenizer_config.json")
