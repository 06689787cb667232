"""A real run reads no fault-injection switch: the tests inject faults by wrapping functions
in their own processes (tests/faults.py), so an environment forwarded to every rank (mpiexec
--envall, .deepspeed_env) cannot alter a run."""

from __future__ import annotations

import ast

from tests.conftest import REPO

# Every project-named variable the product may read, with what it does.
ALLOWED = {"MEGATRON_LITE_PROGRESS"}  # progress bars in preprocessing without a terminal


def _product_files():
    yield REPO / "pretrain.py"
    for folder in ("megatron_lite", "tools", "launch"):
        yield from sorted((REPO / folder).rglob("*.py"))


def _environment_reads(tree: ast.AST):
    """Names read through os.environ.get / os.environ[...] / os.getenv / environ.get."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = ast.unparse(f)
            if name.endswith(("environ.get", "getenv", "environ.setdefault", "environ.pop")):
                yield node.args[0].value
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            if isinstance(node.slice, ast.Constant):
                yield node.slice.value


def test_the_product_reads_no_fault_switch():
    read = {}
    for path in _product_files():
        for name in _environment_reads(ast.parse(path.read_text())):
            if isinstance(name, str) and name.startswith(("MEGATRON_LITE_", "FAULT_")):
                read.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert set(read) <= ALLOWED, {k: v for k, v in read.items() if k not in ALLOWED}


def test_no_product_module_imports_the_tests():
    for path in _product_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
                raise AssertionError(f"{path.relative_to(REPO)} imports {node.module}")
