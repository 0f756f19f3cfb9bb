"""Task files read as the harness's tasks read them, scores worked by hand, and every bad row as one line."""
import json
import math

import pytest

from kiln.evaluate.metrics import (NA, choice_scores, mean_stderr, multiple_choice_results, perplexity_results)
from kiln.evaluate.tasks import TaskError, hellaswag_text, load_task, load_tasks


def test_ties_go_to_the_first_maximum_and_acc_norm_counts_characters():
    assert choice_scores([-1.0, -1.0, -2.0], ["a", "b", "c"], gold=0) == (1.0, 1.0)
    assert choice_scores([-1.0, -1.0, -2.0], ["a", "b", "c"], gold=1) == (0.0, 0.0)
    # "é" is one character (two UTF-8 bytes): -1.5 / 1 < -2.5 / 2, so acc_norm picks "ab" (bytes would pick "é")
    assert choice_scores([-1.5, -2.5], ["é", "ab"], gold=0) == (1.0, 0.0)
    assert choice_scores([-1.5, -2.5], ["é", "ab"], gold=1) == (0.0, 1.0)
    # "日本語" is 3 characters (9 bytes): -6 / 3 = -2 beats -2.5 / 1
    assert choice_scores([-6.0, -2.5], ["日本語", "x"], gold=0) == (0.0, 1.0)
    assert choice_scores([-1.0, -3.0], ["", "abc"], gold=1) == (0.0, 1.0)  # an empty choice: ll / 0 = -inf


def test_aggregates_as_the_harness_reports_them():
    acc = [1.0, 0.0, 1.0, 1.0]  # mean 0.75; sample variance (3·0.0625 + 0.5625) / 3 = 0.25; stderr 0.5 / 2
    assert mean_stderr(acc) == pytest.approx(0.25, abs=1e-15) and mean_stderr([1.0]) == NA
    assert multiple_choice_results([(a, 1 - a) for a in acc]) == {
        "acc,none": 0.75, "acc_stderr,none": pytest.approx(0.25), "acc_norm,none": 0.25,
        "acc_norm_stderr,none": pytest.approx(0.25)}
    # words: re.split(r"\s+") pieces ("a b" 2, "cd\n" 2: the trailing empty piece counts); bytes: UTF-8
    r = perplexity_results([-10.0, -20.0], ["a b", "cé\n"])
    assert r["word_perplexity,none"] == pytest.approx(math.exp(30 / 4))
    assert r["byte_perplexity,none"] == pytest.approx(math.exp(30 / 7))
    assert r["bits_per_byte,none"] == pytest.approx(30 / 7 / math.log(2))
    assert r["bits_per_byte_stderr,none"] == NA


def _write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_hellaswag_and_arc_rows_as_the_harness_preprocesses_them(tmp_path):
    hella = {"activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow covering the "
             "window of a car, and a woman wearing winter clothes smiles.", "ctx_b": "then",
             "endings": [", the man adds wax to the windshield and cuts it.", " [title] Remove the  ice. [step] Scrape",
                         " a person board a ski lift.", ", the man continued removing the snow on his car."],
             "label": "3"}
    arc = {"id": "Mercury_7175875", "question": "An astronomer observes that a planet rotates faster after a "
           "meteorite impact. Which is the most likely effect?",
           "choices": {"text": ["Planetary density will decrease.", "Planetary years will become longer.",
                                "Planetary days will become shorter.", "Planetary gravity will become stronger."],
                       "label": ["A", "B", "C", "D"]}, "answerKey": "C"}
    task = load_task(str(_write(tmp_path, "mixed.jsonl", [hella, arc, {"context": "c", "choices": ["x"],
                                                                      "label": 0}])))
    h, a, k = task.items
    assert h.context == ("Removing ice from car: Then, the man writes over the snow covering the window of a car, "
                         "and a woman wearing winter clothes smiles. Then")
    # the second ending: stripped first, so "[title]" has no space before it and goes with the other [...] markers
    assert h.choices == (", the man adds wax to the windshield and cuts it.", " Remove the ice. Scrape",
                         "a person board a ski lift.", ", the man continued removing the snow on his car.")
    assert h.gold == 3 and a.gold == 2 and k.gold == 0 and task.name == "mixed" and task.kind == "multiple_choice"
    assert a.context == ("Question: An astronomer observes that a planet rotates faster after a meteorite impact. "
                         "Which is the most likely effect?\nAnswer:") and a.choices == tuple(arc["choices"]["text"])
    assert hellaswag_text(" a [header] b   c ") == "a b  c"  # one pass of "  " -> " ", as str.replace


@pytest.mark.parametrize("row, message", [
    ('{"context": "c", "choices": ["a"]', "not valid JSON (Expecting ',' delimiter at column 34)"),
    ('["c", ["a"], 0]', "a row is a JSON object, got list"),
    ({"context": "c", "label": 0}, "the row has no 'choices' field; a row is "
                                   '{"context": str, "choices": [str, ...], "label": int}'),
    ({"context": "c", "choices": [], "label": 0}, "'choices' is an empty choice list; give at least one choice"),
    ({"context": "c", "choices": ["a", "b"], "label": 2}, "label 2 is out of range for 2 choice(s) (0 to 1)"),
    ({"context": "c", "choices": ["a", 3], "label": 0}, "choices[1] is int, not str; a row is "
                                                        '{"context": str, "choices": [str, ...], "label": int}'),
    ({"context": "c", "choices": ["a"], "label": True}, "'label' is bool, not int or str; a row is "
                                                        '{"context": str, "choices": [str, ...], "label": int}'),
    ({"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x"], "label": "1"},
     "label 1 is out of range for 1 choice(s) (0 to 0)"),
    ({"question": "q", "choices": {"text": ["x"], "label": ["A"]}, "answerKey": "B"},
     "answerKey 'B' is not one of the choice labels ['A']"),
], ids=["json", "not-an-object", "missing-field", "empty-choices", "label-range", "choice-type", "label-bool",
        "hellaswag-label", "arc-key"])
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, row, message):
    path = _write(tmp_path, "task.jsonl", [{"context": "fine", "choices": ["a"], "label": 0}, "", row])
    with pytest.raises(TaskError) as e:
        load_task(str(path))
    assert str(e.value) == f"{path}:3: {message}"


def test_text_tasks_and_bad_files(tmp_path):
    text = tmp_path / "wiki.txt"
    text.write_text("one document\n\nwhole")
    assert [d.text for d in load_task(f"text:{text}").items] == ["one document\n\nwhole"]
    docs = _write(tmp_path, "docs.jsonl", [{"body": "a"}, {"body": "b c"}])
    assert [d.text for d in load_task(f"text:{docs}", text_field="body").items] == ["a", "b c"]
    with pytest.raises(TaskError, match=rf"^{docs}:1: the row has no 'text' field; a row is "
                                        r'\{"text": str\} \(--text-field names the field\)$'):
        load_task(f"text:{docs}")
    empty = _write(tmp_path, "empty.jsonl", [])
    with pytest.raises(TaskError, match=rf"^{empty}: holds no rows$"):
        load_task(str(empty))
    with pytest.raises(TaskError, match=rf"^{tmp_path / 'nope.jsonl'}: no such task file$"):
        load_task(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match=rf"^{text}: a multiple-choice task is a .jsonl file .* pass text:{text}$"):
        load_task(str(text))
    (tmp_path / "b").mkdir()
    again = _write(tmp_path / "b", "docs.jsonl", [{"context": "c", "choices": ["a"], "label": 0}])
    with pytest.raises(TaskError, match=rf"^{again}: its name 'docs' is also {docs}'s; results are keyed"):
        load_tasks([f"text:{docs}", str(again)], text_field="body")


def test_a_line_separator_inside_a_json_string_stays_in_its_row(tmp_path):
    """U+2028 may stand unescaped in a JSON string (json.dumps(ensure_ascii=False) writes it so): a row is a line
    ending in \\n, as the harness's JSONL reader reads it."""
    path = tmp_path / "sep.jsonl"
    path.write_text(json.dumps({"context": "a\u2028b", "choices": ["x\u2029", "y"], "label": 1}, ensure_ascii=False)
                    + "\n", encoding="utf-8")
    (item,) = load_task(str(path)).items
    assert item.context == "a\u2028b" and item.choices == ("x\u2029", "y") and item.gold == 1
