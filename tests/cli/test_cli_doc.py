"""docs/cli.md against the parser (kiln.cli.main.build_parser): every subcommand has a section there and every flag
of it appears in its section; nothing in docs/cli.md or the README names a subcommand, a flag or a config key
(`--section.key`) that does not exist.

What is covered: the subcommands (`kiln data prepare` as a path), their options (`--run-dir`, ...), and the config
keys written as `--section.key` (checked against the Config dataclasses; the list of all keys is `kiln train
--help`'s, printed from those dataclasses, so docs/cli.md does not repeat it). Positional arguments are not.

A flag belongs to the command it follows on its line: `$ kiln plan ... --top 5`, `` `kiln train --resume RUN` ``,
`-m kiln train --parallel.tp=2`, `recommended: kiln train ...`; any other flag to the subcommand whose section it is
in. After the name of another program (`torchrun`, `python`, ...) nothing is checked until a `kiln` command starts
or the backtick span ends.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from pathlib import Path

import pytest

from kiln.cli.main import build_parser
from kiln.config import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
CLI_DOC = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"

# Not keys: wrong on purpose (docs/cli.md shows the one-line errors they get), and the placeholder.
NOT_KEYS = {"--model.presett", "--optm.lr", "--section.key"}
FOREIGN = ("torchrun", "python", "python3", "tensorboard", "pip", "sbatch", "srun")

TOKEN = re.compile(
    r"(?P<kiln>(?:^\$ |`|-m |usage: |recommended: |or: )kiln(?P<words>(?: [a-z][a-z-]*)+))"
    r"|(?P<foreign>(?<![\w/-])(?:" + "|".join(FOREIGN) + r")\b)"
    r"|(?P<flag>(?<![\w.-])--[A-Za-z][\w-]*(?:\.[A-Za-z_]\w*)?)"
    r"|(?P<tick>`)")


@functools.cache
def commands() -> dict[str, set[str]]:
    """Every leaf subcommand, "data show" for nested ones: {path: its long option strings}."""
    return _leaves(build_parser(), ())


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> dict[str, set[str]]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_leaves(sub, path + (name,)))
    if path and not out:
        out[" ".join(path)] = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    return out


@functools.cache
def config_keys() -> frozenset[str]:
    return frozenset(f"--{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls))


def _command(words: str, known: dict) -> str | None:
    """The longest subcommand path at the start of `words` (" data show --rows" -> "data show"), None if none."""
    parts = words.split()
    for n in range(len(parts), 0, -1):
        if " ".join(parts[:n]) in known:
            return " ".join(parts[:n])
    return None


def mentions(text: str, known: dict) -> tuple[dict[str | None, list[str]], list[str]]:
    """({section's subcommand: [(owner, flag) ...]} , problems). Sections are the `## ` headings; a heading that
    starts with `kiln SUB` makes SUB the section's subcommand (None otherwise: the README, the presets)."""
    sections: dict[str | None, list[tuple[str | None, str]]] = {}
    problems, default, fenced = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced and line.startswith("## "):
            m = re.match(r"## `kiln((?: [a-z][a-z-]*)+)", line)
            default = _command(m.group(1), known) if m else None
            sections.setdefault(default, [])
            if m and default is None:
                problems.append(f"line {number}: heading names no subcommand: {line}")
                continue
        owner, in_tick = default, False
        for t in TOKEN.finditer(line):
            if t.group("tick"):
                in_tick = not in_tick
                if not in_tick:
                    owner = default  # the end of `kiln ... --flag`
            elif t.group("kiln"):
                in_tick = in_tick or t.group("kiln").startswith("`")
                owner = _command(t.group("words"), known)
                if owner is None:
                    problems.append(f"line {number}: `kiln{t.group('words').split(' --')[0]}` is no subcommand of "
                                    f"kiln ({', '.join(known)})")
            elif t.group("foreign"):
                owner = "(foreign)"
            elif owner != "(foreign)":
                sections.setdefault(default, []).append((owner, t.group("flag")))
                flag = t.group("flag")
                if "." in flag:
                    if flag not in config_keys() and flag not in NOT_KEYS:
                        problems.append(f"line {number}: {flag} is not a config key")
                elif owner is not None and flag not in known[owner] | {"--help"}:
                    problems.append(f"line {number}: kiln {owner} has no flag {flag}")
    return sections, problems


def missing(text: str, known: dict) -> list[str]:
    """What the reference leaves out: a subcommand without a section, a flag absent from its section."""
    sections, _ = mentions(text, known)
    out = []
    for command, flags in known.items():
        if command not in sections:
            out.append(f"kiln {command} has no `## \\`kiln {command} ...\\`` section")
            continue
        named = {flag for owner, flag in sections[command] if owner == command}
        out += [f"kiln {command}: {flag} is not in its section" for flag in sorted(flags - named - {"--help"})]
    return out


def test_cli_doc_covers_every_subcommand_and_flag():
    known = commands()
    text = CLI_DOC.read_text()
    assert missing(text, known) == []
    assert mentions(text, known)[1] == []


def test_readme_names_only_real_subcommands_flags_and_keys():
    assert mentions(README.read_text(), commands())[1] == []


def test_readme_is_read_in_ten_minutes():
    # nanoGPT's is 234 lines; a subcommand's reference goes to docs/cli.md (issue #37)
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines > 250: move reference text to docs/cli.md or a docs/ page"


FAKE = {"train": {"--run-dir", "--resume"}, "data show": {"--rows"}, "plan": {"--top"}}


@pytest.mark.parametrize("text, problems", [
    ("## `kiln train [--run-dir DIR]`\n\n`--resume R` too\n## `kiln data show [--rows R]`\n## `kiln plan --top`\n",
     []),
    ("## `kiln train [--run-dir DIR] [--resume R] [--force]`\n", ["line 1: kiln train has no flag --force"]),
    ("## `kiln train [--run-dir DIR] [--resume R]`\n## `kiln evaluate RUN`\n",
     ["line 2: heading names no subcommand: ## `kiln evaluate RUN`"]),
    ("## `kiln train --run-dir D --resume R`\n$ kiln plan --top 3 --rows 2\n",
     ["line 2: kiln plan has no flag --rows"]),
    ("## `kiln train --run-dir D --resume R`\n`kiln plan --top 3` then `--rows`\n",
     ["line 2: kiln train has no flag --rows"]),  # after the span, the section's subcommand again
    ("## `kiln train --run-dir D --resume R`\n$ torchrun --nproc_per_node=2 -m kiln train --rows=1\n",
     ["line 2: kiln train has no flag --rows"]),  # torchrun's flags unchecked, kiln's checked
    ("## `kiln train --run-dir D --resume R --train.max_steps=3 --trian.max_steps=3 --model.presett=x`\n",
     ["line 1: --trian.max_steps is not a config key"]),
    ("## Presets\n`kiln sampel --prompt x`\n", ["line 2: `kiln sampel` is no subcommand of kiln (train, data show, "
                                              "plan)"]),
    ("## `kiln plan --top`\n```\n## `kiln train --rows` in a code block: output, not a heading\n```\n",
     ["line 3: kiln train has no flag --rows"]),
])
def test_checker_on_small_docs(text, problems):
    assert mentions(text, FAKE)[1] == problems


def test_checker_finds_what_is_left_out():
    text = "## `kiln train [--run-dir DIR]`\n`kiln plan --top 3`\n## `kiln data show`\n"
    assert missing(text, FAKE) == ["kiln train: --resume is not in its section",
                                   "kiln data show: --rows is not in its section",
                                   "kiln plan has no `## \\`kiln plan ...\\`` section"]


# ---------------------------------------------------------------- links
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, only word characters, spaces and hyphens kept, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        fenced = fenced != line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            out.add(slug(line.lstrip("#")))
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of a markdown file whose file or #anchor does not exist."""
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{path.name}: {target}: no file {file}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{path.name}: {target}: {file or path.name} has no heading #{anchor}")
    return out


def test_readme_and_docs_links_resolve():
    assert [problem for doc in [README, *sorted((ROOT / "docs").glob("*.md"))] for problem in broken_links(doc)] == []


def test_link_checker(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## The `kiln plan` search: a, b\n\n```\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text("[ok](a.md) [ok](a.md#the-kiln-plan-search-a-b) [no](a.md#not-a-heading) "
                                   "[no](c.md) [ok](https://example.com/x#y) [self](#missing)\n")
    assert broken_links(tmp_path / "b.md") == ["b.md: a.md#not-a-heading: a.md has no heading #not-a-heading",
                                               "b.md: c.md: no file c.md", "b.md: #missing: b.md has no heading #missing"]
