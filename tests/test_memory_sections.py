"""kiln.memory's functions take the config sections they read, never the whole Config (issue #37; STYLE.md: each
component gets only its own slice of config, as torchtitan's components do).

A public function or method of kiln/memory/ (a name without a leading underscore, in a public class) whose
parameter is annotated `Config` (kiln.config's), or is named `cfg` or `config` with no annotation at all (a Config
passed by duck typing), fails, unless ALLOWED names it with the reason. The estimator's inputs are built from a
Config in one place, kiln.memory.levers.JobSections.of. Like tests/test_layering.py the files are parsed, never
imported (well under a second).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

MEMORY = Path(__file__).resolve().parent.parent / "kiln" / "memory"

# "file:Qualified.name" -> why it takes a whole Config
ALLOWED = {
    "levers.py:JobSections.of": "the one place a Config becomes the sections the estimator and planner read",
}

WHOLE_CONFIG = re.compile(r"(?<![\w.])(kiln\.config\.)?Config\b")  # Config, kiln.config.Config; not ModelConfig
DUCK_NAMES = ("cfg", "config")


def _public(body, prefix=""):
    for node in body:
        if node.__class__ is ast.ClassDef and not node.name.startswith("_"):
            yield from _public(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield f"{prefix}{node.name}", node


def config_parameters(root: Path) -> dict[str, str]:
    """{"file:Qualified.name": "parameter: annotation"} for every public function under `root` given a whole Config."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for name, fn in _public(ast.parse(path.read_text()).body):
            a = fn.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                annotation = ast.unparse(arg.annotation).strip("'\"") if arg.annotation else None
                whole = WHOLE_CONFIG.search(annotation) if annotation else arg.arg in DUCK_NAMES
                if whole:
                    found[f"{path.relative_to(root).as_posix()}:{name}"] = f"{arg.arg}: {annotation or '(none)'}"
    return found


def test_no_memory_function_takes_the_whole_config():
    found = config_parameters(MEMORY)
    taking = [f"kiln/memory/{site}({param})" for site, param in found.items() if site not in ALLOWED]
    assert not taking, ("these take the whole Config; give them the sections they read (kiln.memory.levers."
                        "JobSections, or the section itself):\n" + "\n".join(taking))
    stale = [site for site in ALLOWED if site not in found]
    assert not stale, f"ALLOWED entries that no longer take a Config (remove them): {stale}"
    for site, why in ALLOWED.items():
        assert why.strip() and "\n" not in why, f"ALLOWED[{site!r}] needs a one-line reason"


def test_the_check_finds_each_way_of_taking_a_config(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text(
        "from kiln.config import Config\n"
        "def plain(cfg, device): ...\n"  # duck-typed
        "def typed(x: Config): ...\n"
        "def dotted(*, x: 'kiln.config.Config' = None): ...\n"
        "def optional(config: Config | None = None): ...\n"
        "class Choice:\n"
        "    def on(self, cfg): ...\n"
        "    def _private(self, cfg): ...\n"
        "def fine(cfg: ModelConfig, memory: MemoryConfig, plan_cfg: PlanConfig): ...\n"
        "def _helper(cfg): ...\n"
        "class _Hidden:\n"
        "    def on(self, cfg): ...\n")
    (tmp_path / "sub" / "b.py").write_text("async def later(cfg): ...\n")
    assert set(config_parameters(tmp_path)) == {"a.py:plain", "a.py:typed", "a.py:dotted", "a.py:optional",
                                                 "a.py:Choice.on", "sub/b.py:later"}
