"""kiln's packages stack in layers, and imports only go down; no two modules import each other, by any path.

The modules are parsed with `ast`, never imported: the check takes well under a second, needs no torch, and
still reports everything while a package is half moved. Imports under `if TYPE_CHECKING:` are for type checkers
only and are ignored by the layering; the module cycle check counts every import, function-level and type-only
ones included (a cycle held open by a late import is still two modules that need each other).
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

# Mirrors the README's Layout section: a package added or moved here belongs there too.
LAYERS = [  # bottom to top; a package imports only from packages in lower layers (never sideways, never up)
    ("util", "errors", "precision"),
    ("models", "data"),
    ("perf", "parallel", "interop"),
    ("kernels",),
    ("memory", "numerics", "evaluate"),
    ("train",),
    ("config",),
    ("run", "report"),
    ("cli",),
]

KILN = Path(__file__).resolve().parent.parent / "kiln"
ROOT_MODULES = ("__init__", "__main__")  # kiln/__init__.py and kiln/__main__.py are the public API: they import anything
LAZY_HINT = "move it to the top, or mark it '# lazy: <reason>' if it keeps an optional heavy dependency lazy"


@dataclass(frozen=True)
class Import:
    where: str  # "kiln/memory/levers.py:59"
    source: str | None  # the importing package; None for the root modules
    target: str  # the module imported, resolved: "kiln.train.loop"
    package: str | None  # the target's package, "train"; None when the target is the root package itself
    in_function: bool
    lazy: bool  # a comment containing `lazy:` sits on the import or on the line above it


@dataclass
class Findings:
    layering: list[str]  # imports that go sideways or up, and packages missing from the layers
    cycle: list[str]  # one cycle of the package graph, one "a -> b (where)" step a line; empty when acyclic
    function_level: list[str]  # kiln imports inside a function body that carry no `lazy:` reason


def check(root: Path, layers=LAYERS) -> Findings:
    """Check the package under `root` (a directory such as kiln/) against `layers`, bottom to top."""
    files = sorted(root.rglob("*.py"))
    found = {_package_of(path, root) for path in files} - {None}
    layer_of = {name: i for i, names in enumerate(layers) for name in names}
    imports = [imp for path in files for imp in _imports(path, root, found | layer_of.keys())]

    layering = [f"{_shown(root, name)}: package {name} is not in LAYERS (add it to LAYERS and to the README's Layout)"
                for name in sorted(found - layer_of.keys())]
    for imp in imports:
        if imp.source is None or imp.source not in layer_of or imp.package == imp.source:
            continue  # the root imports anything; a package missing from LAYERS is reported once, above
        if imp.package is None:
            why = f"{root.name} is the root package, which imports every package"
        elif imp.package not in layer_of:
            why = f"{imp.package} is not in LAYERS: add it to LAYERS and to the README's Layout"
        elif layer_of[imp.package] > layer_of[imp.source]:
            why = f"{imp.package} is above {imp.source}"
        elif layer_of[imp.package] == layer_of[imp.source]:
            why = f"{imp.package} is beside {imp.source}, in the same layer"
        else:
            continue
        layering.append(f"{imp.where} {imp.source} -> {imp.package or root.name} ({why})")

    graph: dict[str, dict[str, str]] = {}  # package -> imported package -> where, the first such import
    for imp in imports:
        if imp.source is not None and imp.package is not None and imp.package != imp.source:
            graph.setdefault(imp.source, {}).setdefault(imp.package, imp.where)

    function_level = [f"{imp.where} function-level import of {imp.target} ({LAZY_HINT})"
                      for imp in imports if imp.in_function and not imp.lazy]
    return Findings(_unique(layering), _find_cycle(graph), _unique(function_level))


def _package_of(path: Path, root: Path) -> str | None:
    """kiln/models/transformer.py -> "models", kiln/config.py -> "config", kiln/__init__.py -> None (the root)."""
    parts = path.relative_to(root).with_suffix("").parts
    return None if parts in [(name,) for name in ROOT_MODULES] else parts[0]


def _shown(root: Path, name: str) -> str:
    return f"{root.name}/{name}/" if (root / name).is_dir() else f"{root.name}/{name}.py"


def _imports(path: Path, root: Path, packages: set[str]) -> list[Import]:
    """Every import of the root package in one module, resolved to absolute module names."""
    text = path.read_text()
    shown = path.relative_to(root.parent).as_posix()
    source = _package_of(path, root)
    module = [root.name, *path.relative_to(root).with_suffix("").parts]
    here = module[:-1]  # the package that relative imports start from (a package's __init__ starts from itself)
    lines = ["", *text.splitlines()]  # lines[n] is line n
    found: list[Import] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names if alias.name.split(".")[0] == root.name]
        if node.level:
            base = here[:len(here) - node.level + 1]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name == root.name:  # `from kiln import models` imports a package; `from kiln import X` the root's API
            return [f"{name}.{alias.name}" if alias.name in packages else name for alias in node.names]
        return [name] if name.split(".")[0] == root.name else []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            marked = lines[node.lineno - 1:node.end_lineno + 1]
            lazy = any("lazy:" in line.partition("#")[2] for line in marked)
            for target in targets(node):
                package = target.split(".")[1] if "." in target else None
                found.append(Import(f"{shown}:{node.lineno}", source, target, package, in_function, lazy))
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        type_only = isinstance(node, ast.If) and _is_type_checking(node.test)
        # Imports are statements, so only statement lists are walked (bodies, branches, handlers, match cases):
        # skipping expressions finds the same imports in kiln ~10x faster (6 ms against 58 ms).
        for field in ("orelse",) if type_only else ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, ()):
                visit(child, in_function)

    visit(ast.parse(text, filename=str(path)), in_function=False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _find_cycle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of the package graph as "a -> b (where)" steps, or [] when there is none (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []  # the packages on the current search path

    def visit(package: str) -> list[str]:
        path.append(package)
        for nxt in sorted(graph.get(package, {})):
            if nxt in path:
                loop = path[path.index(nxt):] + [nxt]
                return [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(loop, loop[1:])]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        path.pop()
        done.add(package)
        return []

    for package in sorted(graph):
        if package not in done and (cycle := visit(package)):
            return cycle
    return []


def module_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> module it imports -> where (the first such import), over every import statement of every module
    under `root`: top-level, function-level and `if TYPE_CHECKING:` alike. `from kiln.models import llama` is an
    edge to the module kiln.models.llama; `from kiln.models import Family` one to the package kiln.models."""
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in paths and target != name:
                    where = f"{path.relative_to(root.parent).as_posix()}:{node.lineno}"
                    graph.setdefault(name, {}).setdefault(target, where)
    return graph


def _unique(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(lines))


@functools.cache
def _kiln() -> Findings:
    return check(KILN)


def test_layers_name_each_package_once():
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names)), f"LAYERS lists a package twice: {names}"


def test_imports_only_go_down():
    problems = _kiln().layering
    assert not problems, f"{len(problems)} imports break the layering (see LAYERS):\n" + "\n".join(problems)


def test_no_cycles_between_packages():
    cycle = _kiln().cycle
    assert not cycle, "the packages import each other in a cycle:\n" + "\n".join(cycle)


def test_no_cycles_between_modules_late_and_type_only_imports_included():
    """Two modules that import each other, even through a function-level import or one under TYPE_CHECKING, are
    one module in two files: the shared part belongs in a module below both (kiln.models.catalog, the tables the
    config looks families up in; kiln.train.settings, the section the loop's parts take)."""
    cycle = _find_cycle(module_graph(KILN))
    assert not cycle, "these modules import each other in a cycle:\n" + "\n".join(cycle)


def test_the_module_cycle_check_finds_late_and_type_only_cycles(tmp_path):
    files = {"__init__.py": "", "a.py": "def f():\n    from kiln import b\n",
             "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.a import f\n",
             "p/__init__.py": "from .q import x\n", "p/q.py": "x = 1\n"}
    for name, text in files.items():
        (tmp_path / "kiln" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "kiln" / name).write_text(text)
    assert _find_cycle(module_graph(tmp_path / "kiln")) == ["kiln.a -> kiln.b (kiln/a.py:2)",
                                                             "kiln.b -> kiln.a (kiln/b.py:3)"]
    (tmp_path / "kiln" / "b.py").write_text("x = 1\n")
    assert _find_cycle(module_graph(tmp_path / "kiln")) == []


def test_no_function_level_kiln_imports():
    problems = _kiln().function_level
    assert not problems, f"{len(problems)} function-level kiln imports:\n" + "\n".join(problems)


def test_checker_on_a_synthetic_package(tmp_path):
    files = {
        "__init__.py": "from kiln.top import run\n",  # the root may import anything
        "base.py": """\
            from typing import TYPE_CHECKING
            import typing
            if TYPE_CHECKING:
                from kiln.high import Thing
            if typing.TYPE_CHECKING:
                from kiln.top import run
            """,
        "low/__init__.py": """\
            from ..high import thing
            from kiln import side
            from . import part
            from kiln.base import helper
            """,
        "low/part.py": "from .. import base\n",
        "side.py": "import os\n",
        "high/__init__.py": "from kiln.low import part\nthing = 1\n",
        "high/work.py": """\
            def plain():
                from kiln.base import helper

            def marked_above():
                # lazy: triton is imported only by runs that use the kernels
                from kiln.low import kernel

            def marked_inline():
                import kiln.low.part  # lazy: triton again

            class Runner:
                def step(self):
                    from . import thing
            """,
        "top.py": "import kiln\nfrom kiln.extra import x\n",
        "extra.py": "from kiln import high\n",
    }
    for name, text in files.items():
        path = tmp_path / "kiln" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    layers = [("base",), ("low", "side"), ("high",), ("top",)]

    findings = check(tmp_path / "kiln", layers)

    assert findings.layering == [
        "kiln/extra.py: package extra is not in LAYERS (add it to LAYERS and to the README's Layout)",
        "kiln/low/__init__.py:1 low -> high (high is above low)",
        "kiln/low/__init__.py:2 low -> side (side is beside low, in the same layer)",
        "kiln/top.py:1 top -> kiln (kiln is the root package, which imports every package)",
        "kiln/top.py:2 top -> extra (extra is not in LAYERS: add it to LAYERS and to the README's Layout)",
    ]
    assert findings.cycle == ["high -> low (kiln/high/__init__.py:1)", "low -> high (kiln/low/__init__.py:1)"]
    assert findings.function_level == [
        f"kiln/high/work.py:2 function-level import of kiln.base ({LAZY_HINT})",
        f"kiln/high/work.py:13 function-level import of kiln.high ({LAZY_HINT})",
    ]

    (tmp_path / "kiln" / "low" / "__init__.py").write_text("from kiln.base import helper\n")
    assert check(tmp_path / "kiln", layers).cycle == []


def test_importing_kiln_leaves_triton_and_dynamo_alone():
    """Triton reads TRITON_INTERPRET when its language module is imported (the kernel tests set it first), and
    torch._dynamo imports that module: a kiln module that imports either at load time (torch.distributed.pipelining
    did) breaks the interpreter for the whole process and costs every `kiln` command ~2 s of start-up."""
    code = ("import sys, kiln, kiln.cli.main, kiln.run.lm, kiln.run.fit, kiln.train.step, kiln.parallel.pipeline, "
            "kiln.parallel.tensor; print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=KILN.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
