"""Field docstrings of the schema, read from its source, for ``docs/config.md`` and checks."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from megatron_lite.config import schema
from megatron_lite.config.load import _dataclass_type


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass (the string literal under each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def markdown(cls: type = schema.Config, prefix: str = "") -> str:
    """A markdown reference of every key: name, default, allowed values, meaning."""
    out = []
    if not prefix:
        out.append("# Recipe keys\n\nGenerated from `megatron_lite/config/schema.py` by "
                   "`python -m megatron_lite.config.docs > docs/config.md`.\n")
    docs = field_docs(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(f)
        if sub is not None:
            sections.append((f, sub))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        allowed = f.metadata.get("choices")
        text = docs.get(f.name, "").replace("\n", " ")
        if allowed:
            text += " Allowed: " + ", ".join(f"`{a}`" for a in allowed) + "."
        rows.append(f"| `{prefix}{f.name}` | `{default!r}` | {text} |")
    if rows:
        out.append(f"\n## {prefix[:-1] or 'top level'}\n\n| key | default | meaning |\n|---|---|---|")
        out.extend(rows)
    for f, sub in sections:
        out.append(markdown(sub, f"{prefix}{f.name}."))
    return "\n".join(out) + ("\n" if not prefix else "")


if __name__ == "__main__":
    print(markdown(), end="")
