"""Recipe loading: YAML (with ``base:`` inheritance) + CLI dotlist -> frozen, validated Config.

Problems are collected and raised together as one ``ConfigError`` so that a user fixes a recipe
in one pass, and all of it happens before anything heavy (data, model, processes) is touched.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_lite.config.schema import Config
from megatron_lite.config.validate import validate


class ConfigError(ValueError):
    """One or more problems in a recipe or its overrides."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the recipe:\n{lines}")


def _schema_paths(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted key the schema knows, leaf and section alike."""
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out[path] = f
        sub = _dataclass_type(f)
        if sub is not None:
            out.update(_schema_paths(sub, path + "."))
    return out


def _dataclass_type(f: dataclasses.Field) -> type | None:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return type(default) if dataclasses.is_dataclass(default) else None


def _suggest(key: str, known: Iterable[str]) -> str:
    """'; did you mean X?' using the closest known dotted key (leaf name or full path)."""
    known = list(known)
    leaf = key.rsplit(".", 1)[-1]
    # A right name in the wrong section (training.lr -> optimizer.lr) is the likeliest slip.
    by_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != key]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not by_leaf and not close:
        leaves = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [leaves[c] for c in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)]
    best = (by_leaf or close or [None])[0]
    return f"; did you mean '{best}'?" if best else ""


def _recipe_names(like: str | None = None) -> list[str]:
    """The shipped recipes (``recipes/*.yaml`` of this checkout), or those whose name is close
    to ``like``."""
    shipped = sorted(Path(__file__).resolve().parents[2].glob("recipes/*.yaml"))
    names = {p.stem: f"recipes/{p.name}" for p in shipped}
    if like is None:
        return list(names.values())
    return [names[n] for n in difflib.get_close_matches(like, list(names), n=1, cutoff=0.6)]


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """A recipe's YAML merged over its ``base:`` chain (no schema applied yet)."""
    path = Path(path)
    if not path.is_file():
        if not _seen and "=" in str(path) and not path.suffix == ".yaml":
            raise ConfigError([f"the first argument is the recipe; '{path}' is an override: "
                               f"python pretrain.py recipes/NAME.yaml {path} (the recipes are "
                               f"{', '.join(_recipe_names())})"])
        near = _recipe_names(path.stem)
        raise ConfigError([f"recipe file '{path}' does not exist"
                           + (f"; did you mean {near[0]}?" if near else "")])
    resolved = path.resolve()
    if resolved in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, resolved))
        raise ConfigError([f"recipe 'base:' chain loops: {chain}"])
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # yaml errors carry the line and column
        raise ConfigError([f"recipe '{path}' is not valid YAML: {e}"]) from None
    if not isinstance(node, DictConfig):
        raise ConfigError([f"recipe '{path}' must be a mapping of keys, got {type(node).__name__}"])
    base = node.get("base")
    if base:
        parent = read_recipe(path.parent / str(base), (*_seen, resolved))
        node = OmegaConf.merge(parent, node)
    node["base"] = None
    return node


def _unlock(node: Any) -> None:
    # Frozen dataclasses make every node read-only; unlock to fill values in, the dataclass
    # objects produced at the end are frozen again.
    OmegaConf.set_readonly(node, False)
    if isinstance(node, DictConfig):
        for k in node.keys():
            _unlock(node._get_node(k))


FORMER_VALUES = {"model.activation_checkpointing": {True: "full", False: "none"}}
"""Values a key took before it became a choice, and what they mean now (recipes keep working)."""


def build_config(raw: DictConfig) -> Config:
    """Apply ``raw`` (recipe + overrides) to the schema; collect every problem."""
    schema = OmegaConf.structured(Config)
    _unlock(schema)
    known = _schema_paths(Config)
    problems: list[str] = []
    failed: list[str] = []  # keys whose value could not be applied (left at their default)
    for path, value in _flatten(raw):
        value = FORMER_VALUES.get(path, {}).get(value, value) if isinstance(value, bool) else value
        head = path.split(".", 1)[0]
        if head == "deepspeed":
            continue
        if path not in known:
            # Report the unknown section once, not each key under it.
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                sub = ".".join(parts[:i])
                if sub not in known:
                    msg = f"unknown key '{sub}'{_suggest(sub, known)}"
                    if msg not in problems:
                        problems.append(msg)
                    break
            continue
        if _dataclass_type(known[path]) is not None:
            if value == {}:  # an empty section changes nothing
                continue
            problems.append(f"'{path}' is a section, not a value (got {value!r})")
            continue
        try:
            # merge=True lets a list of mappings become a list of typed entries (data.blend).
            OmegaConf.update(schema, path, value, merge=isinstance(value, list))
        except OmegaConfBaseException as e:
            first = str(e).splitlines()[0]
            problems.append(f"'{path}' = {value!r}: {first}")
            failed.append(path)
    if "deepspeed" in raw:
        ds = raw["deepspeed"]
        if ds is not None and not isinstance(ds, DictConfig):
            problems.append(f"'deepspeed' must be a mapping of DeepSpeed config keys, got {ds!r}")
        elif ds is not None:
            OmegaConf.update(schema, "deepspeed", ds, merge=True)
    # Values that did apply are still checked, so every problem is reported in one pass.
    cfg = OmegaConf.to_object(schema)
    assert isinstance(cfg, Config)
    # ... except checks on keys already reported, which would only describe the default.
    problems += [p for p in validate(cfg) if not any(f"'{k}'" in p for k in failed)]
    if problems:
        raise ConfigError(problems)
    return cfg


def _flatten(node: DictConfig, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k in node.keys():
        v = node._get_node(k)
        path = f"{prefix}{k}"
        if isinstance(v, DictConfig) and path.split(".", 1)[0] != "deepspeed":
            if len(v) == 0:
                yield path, {}
            yield from _flatten(v, path + ".")
        elif isinstance(v, ListConfig):
            yield path, OmegaConf.to_container(v)
        elif isinstance(v, DictConfig):
            yield path, v
        else:
            yield path, v._value()


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings to a config; a malformed one is a ConfigError."""
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError([f"override '{o}' is not of the form dotted.key=value" for o in bad])
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError([f"overrides could not be parsed: {e}"]) from None


def load_config(recipe: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The resolved, validated, frozen config for ``recipe`` with CLI ``overrides`` applied."""
    raw = read_recipe(recipe)
    raw = OmegaConf.merge(raw, parse_overrides(overrides))
    return build_config(raw)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what goes into the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
