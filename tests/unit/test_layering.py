"""The package's layering, as ``docs/architecture.md``'s folder table states it: every import
between folders is one the table allows, and no module imports itself back through others."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_lite"


def allowed_imports() -> dict[str, set[str]]:
    """folder -> the folders it may import, read from the table in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("| folder | holds | may import |", 1)[1].split("\n\n", 1)[0]
    allowed: dict[str, set[str]] = {}
    for row in table.strip().splitlines()[1:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        folder = cells[0].strip("`/")
        rule = re.sub(r"\([^)]*\)", "", cells[-1]).split(";")[0].strip()
        if rule == "nothing of ours":
            allowed[folder] = set()
        elif rule == "everything above":
            allowed[folder] = set(allowed)
        else:
            allowed[folder] = {name.strip() for name in rule.split(",")}
    return allowed


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package's modules ``path`` imports, anywhere in the file (inside functions too):
    ``from pkg import sub`` counts as importing the submodule ``pkg.sub``. Imports only for type
    checkers (``if TYPE_CHECKING:``) count with ``type_checking`` only: they are not run, but a
    cycle through them is still two modules that cannot be read apart."""
    out = set()
    tree = ast.parse(path.read_text())
    hidden = set() if type_checking else {
        id(n) for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("megatron_lite")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_lite"):
            assert node.level == 0, f"{path}: relative import"
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            out |= subs or {node.module}
            if subs and len(subs) < len(node.names):
                out.add(node.module)
    return out


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_imports_between_folders_follow_the_table():
    allowed = allowed_imports()
    known = modules()
    folders = {folder_of(m) for m in known} - {None}
    assert folders == set(allowed), f"folders without a row in the table (or rows without a folder): " \
                                    f"{sorted(folders ^ set(allowed))}"
    wrong = []
    for name, path in known.items():
        mine = folder_of(name)
        for target in imports_of(path, known):
            theirs = folder_of(target)
            if mine and theirs and theirs != mine and theirs not in allowed[mine]:
                wrong.append(f"{name} imports {target} ({mine}/ may import {sorted(allowed[mine])})")
    assert not wrong, "\n".join(wrong)


def test_model_code_never_touches_torch_distributed():
    users = [p for p in (PACKAGE / "model").rglob("*.py") if "torch.distributed" in p.read_text()]
    assert not users, users


def test_no_import_cycles_counting_every_import():
    known = modules()
    graph = {name: {t for t in imports_of(path, known, type_checking=True) if t in known and t != name}
             for name, path in known.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


def test_the_layering_checks_see_a_bad_import(tmp_path):
    """The parser finds imports inside functions and ``from pkg import submodule`` forms."""
    known = modules()
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from megatron_lite.training import trainer\n"
                     "import megatron_lite.config.schema\n"
                     "if TYPE_CHECKING:\n    from megatron_lite.data import indexed\n")
    assert imports_of(probe, known) == {"megatron_lite.training.trainer", "megatron_lite.config.schema"}
    assert imports_of(probe, known, type_checking=True) == {
        "megatron_lite.training.trainer", "megatron_lite.config.schema", "megatron_lite.data.indexed"}


MAX_LINES = 400
EXEMPT = {"megatron_lite/config/schema.py"}  # the declarative schema: one field after another
STILL_TO_SPLIT: set[str] = set()
"""Modules over the limit that are yet to be split; the list only shrinks: one that fits is
taken off it."""


def test_no_module_over_400_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {name for name, n in sizes.items() if n > MAX_LINES} - EXEMPT
    assert over <= STILL_TO_SPLIT, f"modules over {MAX_LINES} lines: {sorted(over - STILL_TO_SPLIT)}"
    fitted = STILL_TO_SPLIT - over
    assert not fitted, f"now within {MAX_LINES} lines, take off STILL_TO_SPLIT: {sorted(fitted)}"


def test_no_module_a_package_init_imports_imports_that_package_by_name():
    """``from pkg import sub`` runs ``pkg/__init__.py`` first: inside a module that
    ``pkg/__init__.py`` itself imports, that is an import cycle (which works only while the
    ``__init__`` happens to import it last). Such modules import their siblings by full name."""
    known = modules()
    wrong = []
    for package, init in known.items():
        if init.name != "__init__.py":
            continue
        for member in imports_of(init, known):
            path = known.get(member)
            if path is None or path.name == "__init__.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == package:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} from {package} import ...")
    assert not wrong, "\n".join(wrong)


def test_starting_a_run_does_not_import_the_compiler():
    """Importing torch._dynamo costs about a second of every process's start (each rank, each
    tool): the run path loads it only where a run compiles (``training.compile``, FlexAttention on
    CUDA) or builds torch's optimizer."""
    import subprocess
    import sys

    probe = ("import sys; import megatron_lite.training.run, megatron_lite.training.entry; "
             "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_preprocessing_and_the_launchers_layout_check_do_not_import_torch(tmp_path):
    """``tools/preprocess_data.py`` (one process or a rank under a launcher) and the launchers'
    ``pretrain.py RECIPE --print-config --world-size N`` never need torch: importing it is a
    second of their start, more on a login node's shared filesystem."""
    import json
    import subprocess
    import sys

    from megatron_lite.data.tokenizers import CharTokenizer

    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "abc cab"}) + "\n")
    CharTokenizer.build("abc cab", tmp_path / "chars.json")
    probe = (
        "import runpy, sys\n"
        "def run(argv):\n"
        "    sys.argv = argv\n"
        "    try:\n"
        "        runpy.run_path(argv[0], run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, (argv, e.code)\n"
        f"run(['tools/preprocess_data.py', '--input', {str(tmp_path / 'in.jsonl')!r}, '--output-prefix',\n"
        f"     {str(tmp_path / 'o')!r}, '--tokenizer-type', 'char', '--tokenizer-model',\n"
        f"     {str(tmp_path / 'chars.json')!r}, '--no-progress', '--rank', '0', '--world-size', '1'])\n"
        "import pretrain\n"  # its __main__ block ends the process (exit_process)
        "assert pretrain.main(['recipes/gpt2-124m.yaml', '--print-config', '--world-size', '8',\n"
        "                      '--gpus-per-node', '4']) == 0\n"
        "print('torch' in sys.modules, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    said = out.stderr.strip().splitlines()
    assert out.returncode == 0 and said[-1:] == ["False"], out.stdout[-2000:] + out.stderr
    assert (tmp_path / "o_text_document.idx").is_file()
