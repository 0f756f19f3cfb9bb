"""Instruction data: a chat record becomes the chat template's token ids and the mask of the tokens the loss counts.

    check_chat(cfg)                             data.records / chat_template / train_on, or one KilnError
    template = chat_template_for(cfg)           the template text, its special tokens and where it came from
    messages = conversation(record, where)      `messages`, or a prompt/completion pair, as a checked conversation
    ids, mask = encode_sample(messages, template, tokenizer, train_on, where)

The text is the template's rendering (kiln.data.chat, as transformers' apply_chat_template renders it) encoded with
its special tokens recognised, so the ids are apply_chat_template(tokenize=True)'s. The mask (train_on=assistant)
holds each assistant turn's content and the template's end-of-turn token (<|im_end|>, <|eot_id|>), not its role
header; every assistant turn of a conversation counts. The spans come from the template's {% generation %} blocks
when it has them (the tokens transformers' return_assistant_tokens_mask marks), else from rendering prefixes of
the conversation: turn i spans from the end of render(messages[:i], add_generation_prompt=True) (the header) to
the end of render(messages[:i + 1]) less trailing whitespace (the newline a template writes after <|im_end|> is
the next header's start, not a token the model must produce). A template that renders earlier turns differently
once later ones follow (Qwen3's drops the reasoning of earlier turns) has no such prefixes: it is refused, with
the fix ({% generation %} blocks, or train_on=all).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.data.chat import TemplateError, chat_template, has_generation, render, render_spans, special_tokens
from kiln.data.corpus import CorpusError
from kiln.errors import KilnError

RECORDS = ("text", "chat")
TRAIN_ON = ("assistant", "all")
ROLES = ("system", "user", "assistant")
# ChatML as Qwen2.5/Qwen3 write it (<|im_start|>role\ncontent<|im_end|>\n), without a default system message.
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")


class ChatRecordError(CorpusError):
    """One chat record that cannot be used: skipped and counted under data.on_bad_record=skip."""


@dataclass(frozen=True)
class Template:
    text: str
    tokens: dict = field(default_factory=dict)  # bos_token, eos_token, ...: names the template may use
    origin: str = "chatml"  # where it came from, for messages
    generation: bool = False  # it has {% generation %} blocks

    @property
    def digest(self) -> str:
        blob = repr((self.text, sorted(self.tokens.items()))).encode("utf-8")
        return hashlib.blake2b(blob, digest_size=8).hexdigest()


def check_chat(cfg) -> None:
    """The chat keys of a DataConfig; one KilnError naming the key and the fix for the first bad value."""
    if cfg.records not in RECORDS:
        raise KilnError(f"data.records={cfg.records!r} is unknown; use one of {RECORDS}",
                        key="data.records", value=cfg.records, fix=f"use one of {RECORDS}")
    if cfg.train_on not in TRAIN_ON:
        raise KilnError(f"data.train_on={cfg.train_on!r} is unknown; use one of {TRAIN_ON}",
                        key="data.train_on", value=cfg.train_on, fix=f"use one of {TRAIN_ON}")
    if cfg.document_mask not in (None, True, False):
        raise KilnError(f"data.document_mask={cfg.document_mask!r} must be true or false",
                        key="data.document_mask", value=cfg.document_mask, fix="give true or false")
    if cfg.records != "chat":
        return
    if cfg.format == "tokens":
        raise KilnError("data.records=chat with data.format=tokens: token files hold no conversations to render; "
                        "give the chat records as jsonl, parquet or arrow",
                        key="data.records", value=cfg.records, fix="give the chat records as jsonl, parquet or arrow")
    if cfg.tokenizer == "bpe":
        raise KilnError("data.records=chat with data.tokenizer=bpe: a new vocabulary has no chat template's special "
                        "tokens; give the model's tokenizer (data.tokenizer=hf:DIR, or model.init=hf:DIR)",
                        key="data.tokenizer", value=cfg.tokenizer,
                        fix="give the model's tokenizer (data.tokenizer=hf:DIR, or model.init=hf:DIR)")
    if cfg.tokenizer == "bytes" and cfg.chat_template == "":
        return  # the tokenizer's template: model.init=hf:DIR may give the tokenizer (kiln.config checks it)
    chat_template_for(cfg)


def chat_template_for(cfg) -> Template:
    """data.chat_template resolved: "" the tokenizer's own (hf:DIR's chat_template.jinja, else its
    tokenizer_config.json's chat_template), chatml kiln's ChatML, else a .jinja file; checked to parse."""
    directory = Path(cfg.tokenizer[3:]) if cfg.tokenizer.startswith("hf:") else None
    tokens = special_tokens(directory) if directory is not None else {}
    if cfg.chat_template == "":
        text = chat_template(directory) if directory is not None else None
        if text is None:
            told = f"data.tokenizer={cfg.tokenizer!r}"
            where = f" ({directory} has no chat_template.jinja and its tokenizer_config.json no chat_template)" \
                if directory is not None else ""
            raise KilnError(f"data.records=chat: {told} has no chat template{where}; set data.chat_template=chatml "
                            f"or data.chat_template=PATH.jinja",
                            key="data.chat_template", value=cfg.chat_template,
                            fix="set data.chat_template=chatml or data.chat_template=PATH.jinja")
        origin = f"{directory}'s chat template"
    elif cfg.chat_template == "chatml":
        text, origin = CHATML, "chatml"
    else:
        path = Path(cfg.chat_template).expanduser()
        if path.suffix != ".jinja" or not path.is_file():
            raise KilnError(f"data.chat_template={cfg.chat_template!r} is neither chatml nor an existing .jinja file; "
                            f"give \"\" (the tokenizer's), chatml or PATH.jinja",
                            key="data.chat_template", value=cfg.chat_template,
                            fix="give \"\" (the tokenizer's), chatml or PATH.jinja")
        text, origin = path.read_text(), str(path)
    try:
        render([{"role": "user", "content": "hi"}], text, tokens)  # compiles it: a syntax error shows here
    except Exception as e:  # noqa: BLE001 - only a syntax error is the template's; the rest is for the records
        if isinstance(e, TemplateError) and "does not parse" in str(e):
            raise KilnError(f"data.chat_template: {origin}: {e}; fix the template or give another",
                            key="data.chat_template", value=cfg.chat_template,
                            fix="fix the template or give another") from None
        # a template may refuse a lone user message (raise_exception): the records decide
    return Template(text, tokens, origin, has_generation(text))


def conversation(record, where: str, need_assistant: bool = True) -> list[dict]:
    """A record's conversation: `messages` [{role, content}], or `prompt`/`completion` (strings: one user turn
    and the assistant's reply; lists of messages: the two joined, as TRL's conversational prompt-completion)."""
    if not isinstance(record, dict):
        raise ChatRecordError(f"{where}: a chat record must be an object with \"messages\" or \"prompt\" and "
                              f"\"completion\", not {type(record).__name__}; fix the record, or set "
                              f"data.on_bad_record=skip")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = prompt + completion
        else:
            raise ChatRecordError(f"{where}: \"prompt\" and \"completion\" must both be strings or both lists of "
                                  f"messages; fix the record, or set data.on_bad_record=skip")
    else:
        raise ChatRecordError(f"{where}: no \"messages\" and no \"prompt\"/\"completion\" (found {sorted(record)}); "
                              f"give each record one of them, or set data.on_bad_record=skip")
    if not isinstance(messages, list) or not messages:
        raise ChatRecordError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}};"
                              f" fix the record, or set data.on_bad_record=skip")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise ChatRecordError(f"{where}: message {i} has role {role!r}; the roles are {list(ROLES)}: fix the "
                                  f"record, or set data.on_bad_record=skip")
        if not isinstance(m.get("content"), str):
            raise ChatRecordError(f"{where}: message {i} ({m['role']}) has no string \"content\"; fix the record, or "
                                  f"set data.on_bad_record=skip")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ChatRecordError(f"{where}: no assistant turn, so data.train_on=assistant counts nothing in it; add the "
                              f"assistant's reply, set data.train_on=all, or data.on_bad_record=skip")
    return messages


def encode_sample(messages: list[dict], template: Template, tokenizer, train_on: str, where: str):
    """(ids int64, mask bool): the rendered conversation's token ids and which of them the loss counts."""
    try:
        if template.generation:
            text, spans = render_spans(messages, template.text, template.tokens)
        else:
            text = render(messages, template.text, template.tokens, add_generation_prompt=False)
            spans = _prefix_spans(messages, template, text, where) if train_on == "assistant" else []
    except KilnError:
        raise  # the template's prefixes: not one record's fault
    except TemplateError as e:
        raise ChatRecordError(f"{where}: {e}; fix the record (or the template), or set data.on_bad_record=skip") \
            from None
    except Exception as e:  # the template is code: a record it cannot handle (a None it adds to a string) fails it
        raise ChatRecordError(f"{where}: the chat template fails on it ({type(e).__name__}: {e}); fix the record (or "
                              f"the template), or set data.on_bad_record=skip") from None
    ids, offsets = tokenizer.chat_offsets(text)
    ids = np.asarray(ids, dtype=np.int64)
    if train_on == "all":
        return ids, np.ones(len(ids), dtype=bool)
    return ids, span_mask(offsets, len(text), spans)


def span_mask(offsets, n_chars: int, spans) -> np.ndarray:
    """The tokens the character spans cover, as transformers' return_assistant_tokens_mask marks them: from the
    token holding a span's first character to the token holding its last (char_to_token: the first token whose
    offsets hold the character)."""
    first = np.full(n_chars + 1, -1, dtype=np.int64)
    for t in range(len(offsets) - 1, -1, -1):  # backwards: the first token holding a character wins
        a, b = offsets[t]
        first[a:b] = t
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        if end <= start:
            continue
        a, b = first[start], first[end - 1]
        if a < 0:
            break  # as transformers: a span whose start no token holds ends the marking
        mask[a:(b + 1 if b >= 0 else len(offsets))] = True
    return mask


def _prefix_spans(messages: list[dict], template: Template, text: str, where: str) -> list[tuple[int, int]]:
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(messages[:i], template.text, template.tokens, add_generation_prompt=True)
        upto = render(messages[:i + 1], template.text, template.tokens, add_generation_prompt=False).rstrip()
        if not (text.startswith(head) and text.startswith(upto) and len(head) <= len(upto)):
            raise KilnError(f"{where}: the chat template ({template.origin}) does not render message {i}'s prefix of "
                            f"the conversation as the start of the whole, so the assistant's tokens cannot be found; "
                            f"mark them with {{% generation %}}...{{% endgeneration %}} in the template, or set "
                            f"data.train_on=all",
                            key="data.chat_template", value=template.origin,
                            fix="mark the assistant's text with {% generation %} blocks, or set data.train_on=all")
        spans.append((len(head), len(upto)))
    return spans
