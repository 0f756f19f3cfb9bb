"""Two rules on kiln's files, each with a named allowlist whose every entry says why (issue #37):

- no module over MAX_LINES lines: a file a reader can hold in their head (nanoGPT's model is ~330 lines);
- a package's `__init__.py` only re-exports: a docstring, imports, `__all__` (and `__version__`), so a reader finds
  the code in the module its name says, and importing the package runs nothing.

A new violation fails with the file and the fix; an allowlist entry that is no longer needed fails too, so the
lists only shrink. Like tests/test_layering.py the files are parsed, never imported (well under a second).
"""
from __future__ import annotations

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parent.parent / "kiln"
MAX_LINES = 400

# path under kiln/ -> why it may be longer than MAX_LINES (line counts of 2026-11-27)
LONG_FILES = {
    "memory/estimate.py": "1,206: the estimator (saved tensors, model state, the step's timeline); the norm, MLP and "
                          "positions formulas moved to kiln/models/costs.py (#37), LoRA's and ep's to "
                          "kiln/memory/adapters.py and experts.py (#38, #41)",
    "train/checkpoint.py": "667: one on-disk format written, verified, resumed and resharded across layouts",
    "memory/planner.py": "712: the step-time model and the search over levers and layouts (ep included)",
    "data/prepare.py": "595: the corpus cut into pieces, tokenized by worker processes and resumed after a kill",
    "data/records.py": "526: a worker that imports nothing from kiln (no torch), reading every source format",
}

# package __init__.py under kiln/ -> why it holds more than re-exports
INIT_IMPLEMENTATION = {
    "models/__init__.py": "build_model; to be split by #37",
    "kernels/__init__.py": "Triton is optional: its imports sit under `if HAS_TRITON`, else a __getattr__ that "
                           "names the fix",
}

METADATA = ("__all__", "__version__")


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every .py file under root longer than `limit` lines: {path relative to root: lines}."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[path.relative_to(root).as_posix()] = n
    return out


def _reexport(node: ast.stmt, first: bool) -> bool:
    if first and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, str):
        return True  # the docstring
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
        else []
    return bool(targets) and all(isinstance(t, ast.Name) and t.id in METADATA for t in targets)


def init_implementation(root: Path) -> dict[str, list[str]]:
    """Every package __init__.py under root holding more than re-exports: {path relative to root: ["line N: what"]}.
    The root package's own __init__.py counts too."""
    out = {}
    for path in sorted(root.rglob("__init__.py")):
        body = ast.parse(path.read_text()).body
        found = [f"line {node.lineno}: {_what(node)}" for i, node in enumerate(body) if not _reexport(node, i == 0)]
        if found:
            out[path.relative_to(root).as_posix()] = found
    return out


def _what(node: ast.stmt) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return f"{'class' if isinstance(node, ast.ClassDef) else 'def'} {node.name}"
    return ast.unparse(node).splitlines()[0][:80]


def _problems(long: dict[str, int], init: dict[str, list[str]], allowed_long=None, allowed_init=None) -> list[str]:
    allowed_long = LONG_FILES if allowed_long is None else allowed_long
    allowed_init = INIT_IMPLEMENTATION if allowed_init is None else allowed_init
    out = [f"kiln/{p}: {n} lines > {MAX_LINES}: split it by what its parts do (or, if it must stay whole, add it "
           f"to LONG_FILES in tests/test_files.py with the reason)" for p, n in long.items() if p not in allowed_long]
    out += [f"kiln/{p} is within {MAX_LINES} lines now: remove it from LONG_FILES" for p in allowed_long
            if p not in long]
    out += [f"kiln/{p} holds implementation ({'; '.join(what[:3])}): move it to a module of the package and "
            f"re-export it here" for p, what in init.items() if p not in allowed_init]
    out += [f"kiln/{p} only re-exports now: remove it from INIT_IMPLEMENTATION" for p in allowed_init
            if p not in init]
    return out


def test_kiln_files_keep_both_rules():
    problems = _problems(long_files(KILN), init_implementation(KILN))
    assert not problems, "\n".join(problems)


def test_every_allowlist_entry_has_a_reason():
    for name, table in (("LONG_FILES", LONG_FILES), ("INIT_IMPLEMENTATION", INIT_IMPLEMENTATION)):
        for path, why in table.items():
            assert why.strip() and "\n" not in why, f"{name}[{path!r}] needs a one-line reason"


def test_the_checkers_find_each_violation(tmp_path):
    root = tmp_path / "pkg"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "c").mkdir()
    (root / "a" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (root / "a" / "exact.py").write_text("x = 1\n" * MAX_LINES)
    (root / "__init__.py").write_text('"""The root."""\nfrom pkg.a import exact\n__version__ = "1"\n')
    (root / "a" / "__init__.py").write_text('"""Re-exports only."""\nimport os\nfrom pkg.a.exact import x\n'
                                            '__all__ = ["x"]\n')
    (root / "b" / "__init__.py").write_text('"""Code."""\nimport os\n\n\ndef helper():\n    return os.sep\n')
    (root / "c" / "__init__.py").write_text('from pkg.a import exact\nLIMIT = 3\n"""not a docstring here"""\n')

    long = long_files(root)
    assert long == {"a/long.py": MAX_LINES + 1}
    init = init_implementation(root)
    assert init == {"b/__init__.py": ["line 5: def helper"],
                    "c/__init__.py": ["line 2: LIMIT = 3", "line 3: 'not a docstring here'"]}

    problems = _problems(long, init, allowed_long={}, allowed_init={"b/__init__.py": "why", "d/__init__.py": "gone"})
    assert problems == [
        f"kiln/a/long.py: {MAX_LINES + 1} lines > {MAX_LINES}: split it by what its parts do (or, if it must stay "
        f"whole, add it to LONG_FILES in tests/test_files.py with the reason)",
        "kiln/c/__init__.py holds implementation (line 2: LIMIT = 3; line 3: 'not a docstring here'): move it to a "
        "module of the package and re-export it here",
        "kiln/d/__init__.py only re-exports now: remove it from INIT_IMPLEMENTATION"]
    assert _problems(long, init, allowed_long={"a/long.py": "why"},
                     allowed_init={"b/__init__.py": "why", "c/__init__.py": "why"}) == []
