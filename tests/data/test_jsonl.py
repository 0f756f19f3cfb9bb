"""kiln.data.jsonl: the one JSONL line reader of chat sources, prompt files and task files."""
from __future__ import annotations

import io
import json

import pytest

from kiln.data.jsonl import JsonlError, jsonl_rows
from kiln.errors import KilnError

# Every character str.splitlines breaks at besides \n and \r (Python's docs list them), each legal unescaped inside a
# JSON string: a reader that split with it would cut these rows in two.
SPLITLINES_ONLY = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


ROWS = [{"text": f"row {i} {c}"} for i, c in enumerate(SPLITLINES_ONLY)] + [{"n": 1}, [1, 2], "s"]


def test_text_and_bytes_give_the_same_rows_and_line_numbers(tmp_path):
    want = ROWS
    lines = [json.dumps(r, ensure_ascii=False) for r in want]
    lines.insert(2, "")  # blank lines are skipped but counted
    lines.insert(5, "   \t")
    text = "\n".join(lines) + "\n"
    assert len(text.splitlines()) > len(lines) + 1  # splitlines would cut the rows: the test would see it
    numbers = [n for n, line in enumerate(lines, 1) if line.strip()]

    from_text = list(jsonl_rows(text, "a.jsonl"))
    from_bytes = list(jsonl_rows(io.BytesIO(text.encode("utf-8")), "a.jsonl"))
    assert from_text == from_bytes == list(zip(numbers, want))
    assert from_text[0][1]["text"] == "row 0 \x0b"


def test_a_crlf_file_reads_as_its_rows():
    assert list(jsonl_rows('{"a": 1}\r\n\r\n{"a": 2}\r\n', "w.jsonl")) == [(1, {"a": 1}), (3, {"a": 2})]


def test_bad_json_names_the_file_line_and_column():
    text = '{"a": 1}\n\n{"a": oops}\n{"a": 3}\n'
    with pytest.raises(JsonlError) as info:
        list(jsonl_rows(text, "dir/b.jsonl"))
    e = info.value
    assert isinstance(e, KilnError) and isinstance(e, ValueError)
    assert (e.where, e.line, e.column, e.key) == ("dir/b.jsonl:3", 3, 7, "dir/b.jsonl")
    assert e.reason == json.JSONDecodeError("Expecting value", '{"a": oops}', 6).msg
    assert str(e) == "dir/b.jsonl:3: not valid JSON (Expecting value at column 7); write one JSON value per line"
    assert e.__context__ is None and e.__cause__ is None  # one line at the CLI, no "during handling of" chain


def test_skip_bad_yields_the_error_in_place_and_goes_on():
    data = b'{"a": 1}\n{"a": "caf\xe9"}\n{"a": 2\n{"a": 3}\n'
    got = list(jsonl_rows(io.BytesIO(data), "c.jsonl", skip_bad=True))
    assert [n for n, _ in got] == [1, 2, 3, 4]
    assert got[0][1] == {"a": 1} and got[3][1] == {"a": 3}
    not_utf8, unclosed = got[1][1], got[2][1]
    assert isinstance(not_utf8, JsonlError) and not_utf8.where == "c.jsonl:2" and not_utf8.column is None
    assert not_utf8.reason == "byte 10 of the line is not UTF-8"  # é in Latin-1 after the 10 bytes {"a": "caf
    assert isinstance(unclosed, JsonlError) and unclosed.where == "c.jsonl:3" and unclosed.column == 8


def test_an_empty_file_yields_nothing():
    assert list(jsonl_rows("", "e.jsonl")) == list(jsonl_rows("\n \n", "e.jsonl")) == []


def test_the_three_readers_name_the_same_line(tmp_path):
    """A prompt file, a task file and a chat source with a U+2028 row, a blank line and bad JSON on line 4: each
    caller's own words, and the line an editor shows (a caller splitting with str.splitlines would say 5)."""
    from kiln.data import DataConfig
    from kiln.data.chat_data import chat_records
    from kiln.evaluate.tasks import TaskError, load_task
    from kiln.run.sample import read_prompt_file

    def write(name: str, row: dict) -> str:
        path = tmp_path / name
        marked = {k: v + "\u2028" if isinstance(v, str) else v for k, v in row.items()}
        path.write_text(json.dumps(row, ensure_ascii=False) + "\n" + json.dumps(marked, ensure_ascii=False)
                        + "\n\n" + '{"x": oops}\n', encoding="utf-8")
        return str(path)

    prompts = write("p.jsonl", {"prompt": "a b"})
    with pytest.raises(ValueError, match=r"p.jsonl:4: not a JSON object \(Expecting value\); write one object"):
        read_prompt_file(prompts)
    task = write("t.jsonl", {"context": "a", "choices": ["a", "b"], "label": 0})
    with pytest.raises(TaskError, match=r"t.jsonl:4: not valid JSON \(Expecting value at column 7\)$"):
        load_task(task)
    chat = write("c.jsonl", {"prompt": "a", "completion": "b"})
    got = list(chat_records(DataConfig(source=chat)))
    assert [where for where, _ in got] == [f"{chat}:1", f"{chat}:2", f"{chat}:4"]
    assert got[1][1]["prompt"] == "a\u2028"
    assert str(got[2][1]).startswith(f"{chat}:4: not a JSON object (Expecting value); each line must be one record")
