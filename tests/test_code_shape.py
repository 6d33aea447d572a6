"""Code shape limits of issue 13: no product module over 300 lines, no function over 60.

A function may pass 60 lines only where a comment on the line(s) right above its `def`
(or its first decorator) starts with ``# long:`` and says why splitting would hurt.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("api", "bench", "cli", "engine", "kernels", "loadgen", "operator", "tuner")
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60
JUSTIFICATION = "# long:"


def _product_files() -> list[Path]:
    return sorted(p for pkg in PRODUCT_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _justified(lines: list[str], first_line: int) -> bool:
    """True when the comment block right above line ``first_line`` (1-based) holds ``# long:``."""
    index = first_line - 2
    while index >= 0 and lines[index].strip().startswith("#"):
        if lines[index].strip().startswith(JUSTIFICATION):
            return True
        index -= 1
    return False


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line name (N lines)`` for each unjustified function over the limit."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES and not _justified(lines, first):
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_product_module_over_300_lines():
    too_long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in _product_files()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, "modules over 300 lines: " + ", ".join(too_long)


def test_no_product_function_over_60_lines_without_a_reason():
    too_long = [entry for p in _product_files() for entry in long_functions(p)]
    assert not too_long, "functions over 60 lines without '# long:': " + ", ".join(too_long)


def test_checker_sees_a_long_function_and_its_reason(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    bare = tmp_path / "bare.py"
    bare.write_text("def f():\n" + body)
    reasoned = tmp_path / "reasoned.py"
    reasoned.write_text("# long: a flat table reads best in one piece\n@staticmethod\ndef f():\n" + body)
    assert long_functions(bare, tmp_path) == ["bare.py:1 f (61 lines)"]
    assert long_functions(reasoned, tmp_path) == []


MAX_FILES_PER_FOLDER = 15
GROUPED_PACKAGES = ("engine", "tuner", "operator")


def test_no_engine_tuner_or_operator_folder_holds_more_than_15_files():
    """Issue 51: the folders show the architecture (vLLM v1's core / engine / worker / executor /
    metrics, the tuner's search / measure / local / cluster / report, the operator's render /
    runtime); a folder that grows past 15 files at one level is split, not left flat."""
    crowded = []
    for pkg in GROUPED_PACKAGES:
        for folder in [ROOT / pkg, *(d for d in (ROOT / pkg).rglob("*") if d.is_dir())]:
            if folder.name == "__pycache__":
                continue
            files = [p for p in folder.iterdir() if p.is_file() and not p.name.endswith(".pyc")]
            if len(files) > MAX_FILES_PER_FOLDER:
                crowded.append(f"{folder.relative_to(ROOT)} ({len(files)} files)")
    assert not crowded, "folders over 15 files: " + ", ".join(crowded)


def missing_docstrings(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line Name`` for each public class, function and method of ``path`` (a name not
    starting with ``_``; functions nested in functions are not public) without a docstring."""
    found = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            if ast.get_docstring(node) is None:
                found.append(f"{path.relative_to(root)}:{node.lineno} {prefix}{node.name}")
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{prefix}{node.name}.")

    walk(ast.parse(path.read_text()).body, "")
    return found


def test_every_public_function_and_class_of_the_product_has_a_docstring():
    """Issue 51: every public class, function and method of the product says what it does (with
    shapes, units, errors and sources where they apply: STYLE.md); the count stays at zero."""
    missing = [entry for p in _product_files() for entry in missing_docstrings(p)]
    assert not missing, f"{len(missing)} public names without a docstring: " + ", ".join(missing)


def test_the_product_uses_absolute_imports_only():
    """Issue 51: every package imports by its full kvpilot.* name (the operator was the last with
    relative imports), so a moved module is found by one search for its dotted name."""
    relative = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in _product_files()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert not relative, "relative imports: " + ", ".join(relative)
