"""Task files: multiple choice from JSONL, and text for perplexity, read into items the scorer takes.

A multiple-choice row is one of three shapes, told apart by its fields:

    {"context": str, "choices": [str, ...], "label": int}                      kiln's own
    {"activity_label", "ctx_a", "ctx_b", "endings", "label"}                    HellaSwag (Rowan/hellaswag)
    {"question", "choices": {"text": [...], "label": [...]}, "answerKey"}       ARC (allenai/ai2_arc)

HellaSwag and ARC rows become a context and choices exactly as lm-evaluation-harness 0.4's hellaswag and
arc_easy / arc_challenge tasks make them (its tasks/hellaswag/utils.py and tasks/arc/*.yaml).

`text:FILE` is a perplexity task: a .jsonl file is one document per row (its --text-field, default "text"), any
other file one document.

Every problem with a row is a TaskError naming FILE:LINE, what is wrong and the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kiln.data.jsonl import JsonlError, jsonl_rows
from kiln.errors import KilnError

TEXT_PREFIX = "text:"
KILN_ROW = '{"context": str, "choices": [str, ...], "label": int}'


class TaskError(KilnError):
    """A task file that cannot be scored: the message names FILE:LINE."""


@dataclass(frozen=True)
class Choice:
    """One multiple-choice item: each choice is scored as the continuation " " + choice of the context."""
    where: str  # FILE:LINE
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Document:
    """One document of a perplexity task, scored whole by rolling windows."""
    where: str
    text: str


@dataclass(frozen=True)
class Task:
    name: str  # the file's stem: results[name], task_<name>_acc
    path: Path
    kind: str  # "multiple_choice" | "perplexity"
    items: tuple  # Choice or Document items, in file order


def load_task(spec: str, text_field: str = "text") -> Task:
    """The task `spec` names: a multiple-choice JSONL file, or text:FILE (perplexity)."""
    if spec.startswith(TEXT_PREFIX):
        path = Path(spec[len(TEXT_PREFIX):])
        return Task(path.stem, path, "perplexity", tuple(_documents(path, text_field)))
    path = Path(spec)
    if path.suffix != ".jsonl":
        raise TaskError(f"{path}: a multiple-choice task is a .jsonl file (one {KILN_ROW} a line, or HellaSwag or "
                        f"ARC rows); for perplexity on a text file pass text:{path}")
    return Task(path.stem, path, "multiple_choice", tuple(_rows(path, _choice)))


def load_tasks(specs: list[str], text_field: str = "text") -> list[Task]:
    """Every task of `specs`, refused as a whole when two share a name (their results would collide)."""
    tasks = [load_task(s, text_field) for s in specs]
    seen: dict[str, Path] = {}
    for t in tasks:
        if t.name in seen:
            raise TaskError(f"{t.path}: its name {t.name!r} is also {seen[t.name]}'s; results are keyed by the "
                            f"file's stem, so rename one of them")
        seen[t.name] = t.path
    return tasks


def _read(path: Path) -> str:
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text (byte {e.start}); a task file is UTF-8 JSONL or text") from None


def _rows(path: Path, parse):
    """parse(row, where) for every non-blank line of a JSONL file; a file without rows is an error."""
    count = 0
    for number, row in jsonl_rows(_read(path), path, skip_bad=True):  # lines break at \n only (kiln.data.jsonl)
        where = f"{path}:{number}"
        if isinstance(row, JsonlError):
            raise TaskError(f"{where}: not valid JSON ({row.reason} at column {row.column})")
        if not isinstance(row, dict):
            raise TaskError(f"{where}: a row is a JSON object, got {type(row).__name__}")
        count += 1
        yield parse(row, where)
    if not count:
        raise TaskError(f"{path}: holds no rows")


def _field(row: dict, key: str, kind, where: str, shape: str):
    if key not in row:
        raise TaskError(f"{where}: the row has no {key!r} field; a row is {shape}")
    value = row[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TaskError(f"{where}: {key!r} is {type(value).__name__}, not {want}; a row is {shape}")
    return value


def _strings(values, key: str, where: str, shape: str) -> tuple[str, ...]:
    if not values:
        raise TaskError(f"{where}: {key!r} is an empty choice list; give at least one choice")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TaskError(f"{where}: {key}[{i}] is {type(v).__name__}, not str; a row is {shape}")
    return tuple(values)


def _label(value, n: int, key: str, where: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():  # HellaSwag's labels are strings: "2"
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskError(f"{where}: {key!r} is {type(value).__name__}, not an int (the index of the right choice)")
    if not 0 <= value < n:
        raise TaskError(f"{where}: {key} {value} is out of range for {n} choice(s) (0 to {n - 1})")
    return value


def _choice(row: dict, where: str) -> Choice:
    if "endings" in row:  # HellaSwag
        return _hellaswag(row, where)
    if "answerKey" in row:  # ARC
        return _arc(row, where)
    context = _field(row, "context", str, where, KILN_ROW)
    choices = _strings(_field(row, "choices", list, where, KILN_ROW), "choices", where, KILN_ROW)
    gold = _label(_field(row, "label", (int, str), where, KILN_ROW), len(choices), "label", where)
    return Choice(where, context, choices, gold)


HELLASWAG_ROW = '{"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": [str, ...], "label": int} (HellaSwag)'


def hellaswag_text(text: str) -> str:
    """lm-evaluation-harness's hellaswag `preprocess`: strip, " [title]" becomes ". ", other [bracketed] WikiHow
    markers go, then each double space becomes one (a single pass, as str.replace does)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict, where: str) -> Choice:
    parts = [_field(row, k, str, where, HELLASWAG_ROW) for k in ("activity_label", "ctx_a", "ctx_b")]
    label, ctx_a, ctx_b = parts
    endings = _strings(_field(row, "endings", list, where, HELLASWAG_ROW), "endings", where, HELLASWAG_ROW)
    gold = _label(_field(row, "label", (int, str), where, HELLASWAG_ROW), len(endings), "label", where)
    context = hellaswag_text(label + ": " + ctx_a + " " + ctx_b.capitalize())
    return Choice(where, context, tuple(hellaswag_text(e) for e in endings), gold)


ARC_ROW = '{"question": str, "choices": {"text": [str, ...], "label": [str, ...]}, "answerKey": str} (ARC)'


def _arc(row: dict, where: str) -> Choice:
    question = _field(row, "question", str, where, ARC_ROW)
    choices = _field(row, "choices", dict, where, ARC_ROW)
    texts = _strings(_field(choices, "text", list, where, ARC_ROW), "choices.text", where, ARC_ROW)
    labels = _field(choices, "label", list, where, ARC_ROW)
    key = _field(row, "answerKey", str, where, ARC_ROW)
    if len(labels) != len(texts):
        raise TaskError(f"{where}: choices.label has {len(labels)} entries and choices.text {len(texts)}; they "
                        f"pair up one to one")
    if key not in labels:
        raise TaskError(f"{where}: answerKey {key!r} is not one of the choice labels {labels}")
    # the harness's arc yaml: doc_to_text "Question: {{question}}\nAnswer:", gold choices.label.index(answerKey)
    return Choice(where, f"Question: {question}\nAnswer:", texts, labels.index(key))


def _documents(path: Path, text_field: str) -> list[Document]:
    if path.suffix != ".jsonl":
        text = _read(path)
        if not text:
            raise TaskError(f"{path}: the file is empty; a perplexity task needs text")
        return [Document(str(path), text)]
    shape = f'{{"{text_field}": str}} (--text-field names the field)'

    def parse(row, where):
        text = _field(row, text_field, str, where, shape)
        if not text:
            raise TaskError(f"{where}: {text_field!r} is empty; a document needs text (remove the row)")
        return Document(where, text)

    return list(_rows(path, parse))
