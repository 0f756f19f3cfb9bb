"""The one JSONL line reader: a chat source (kiln.data.chat_data), `kiln sample --prompts` (kiln.run.sample) and
`kiln eval`'s task files (kiln.evaluate.tasks) read their rows through it.

    for number, obj in jsonl_rows(text_or_binary_lines, path):   (1-based line number, parsed JSON value)

Lines break at "\\n" only. str.splitlines also breaks at U+2028, U+2029, \\x1c-\\x1e, \\x85 and others, which JSON
allows unescaped inside a string, so it would cut such a row in two; a binary file object breaks at b"\\n" only.
Blank lines are skipped but counted, so every number is the line an editor shows. A line that is not JSON raises
JsonlError (a KilnError whose key is the file and whose message names file:line and the column); with
skip_bad=True it is yielded in place of the value instead, so a caller may count it and go on
(data.on_bad_record=skip). The prepare workers' own fast reader (kiln.data.records) imports nothing from kiln and
keeps its own scanner.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from kiln.errors import KilnError


class JsonlError(KilnError):
    """A line of a JSONL file that is not JSON: `where` is "FILE:LINE", `reason` json's words, `column` 1-based (None
    for a line that is not UTF-8)."""

    def __init__(self, path: Path | str, line: int, reason: str, column: int | None):
        self.where, self.line, self.reason, self.column = f"{path}:{line}", line, reason, column
        at = f" at column {column}" if column is not None else ""
        super().__init__(f"{self.where}: not valid JSON ({reason}{at}); write one JSON value per line",
                         key=str(path), value=line, fix="write one JSON value per line")


def jsonl_rows(lines: str | Iterable[bytes], path: Path | str, skip_bad: bool = False) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line: `lines` is the file's whole text (str, split at "\\n" only) or
    its lines as bytes (a binary file object; json decodes each as UTF-8). A bad line raises JsonlError, or with
    skip_bad=True is yielded as (line number, JsonlError)."""
    text = isinstance(lines, str)
    for number, line in enumerate(lines.split("\n") if text else lines, 1):
        if not text:  # without its b"\n", which json would count as a line of its own in an error's column
            line = line.removesuffix(b"\n")
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            bad = JsonlError(path, number, e.msg, e.colno)
        except UnicodeDecodeError as e:  # bytes that are not UTF-8
            bad = JsonlError(path, number, f"byte {e.start} of the line is not UTF-8", None)
        else:
            yield number, value
            continue
        if not skip_bad:
            raise bad
        yield number, bad
