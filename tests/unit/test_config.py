import ast
import re
from pathlib import Path

import pytest

from megatron_lite.config import ConfigError, load_config, to_yaml
from tests.conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates(recipe):
    cfg = load_config(recipe)
    assert to_yaml(cfg)


def test_misspelled_key_names_key_and_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "recipes/shakespeare-char.yaml", ["model.n_layer=2"])
    assert "model.n_layer" in str(e.value) and "'model.n_layers'" in str(e.value)


def test_key_in_wrong_section_suggests_right_section():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "recipes/shakespeare-char.yaml", ["training.lr=0.1"])
    assert "did you mean 'optimizer.lr'" in str(e.value)


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "recipes/shakespeare-char.yaml", [
            "model.d_modle=3", "model.n_heads=abc", "model.norm=batchnorm",
            "optimizer.min_lr=1.0", "training.global_batch_size=13"])
    problems = e.value.problems
    assert len(problems) == 5, problems
    text = str(e.value)
    assert "'model.d_model'" in text
    assert "'model.n_heads' = 'abc'" in text
    assert "'layernorm'" in text and "'rmsnorm'" in text  # allowed values named
    assert "optimizer.min_lr" in text and "global_batch_size" in text


@pytest.mark.parametrize("override, says", [
    ("optimizer.lr=inf", "'optimizer.lr' = inf must be a finite number"),
    ("model.init_std=inf", "'model.init_std' = inf must be a finite number"),
    ("model.init_std=-1", "'model.init_std' = -1.0 must be positive"),
    ("optimizer.beta1=1.0", "'optimizer.beta1' = 1.0 must be in [0, 1)"),
    ("optimizer.beta2=1.5", "'optimizer.beta2' = 1.5 must be in [0, 1)"),
    ("optimizer.weight_decay=-1", "'optimizer.weight_decay' = -1.0 must be 0 or more"),
    ("optimizer.eps=0", "'optimizer.eps' = 0.0 must be positive"),
    ("data.blend=[{prefix: a, weight: .inf}, {prefix: b, weight: 1.0}]",
     "'data.blend[0].weight' = inf must be a finite number"),
    ("data.seed=-1", "'data.seed' = -1 must be 0 or more"),
    ("training.sample_temperature=-1", "'training.sample_temperature' = -1.0 must be 0 or more"),
    ("training.exit_duration_mins=-1", "'training.exit_duration_mins' = -1.0 must be positive"),
    ("training.exit_duration_mins=0", "'training.exit_duration_mins' = 0.0 must be positive"),
])
def test_values_torch_would_refuse_late_or_use_wrongly_are_recipe_problems(override, says):
    """Each passed the recipe check once and then trained on NaN, failed with a traceback after
    the model was built, or stopped at the first step with exit status 0."""
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "recipes/shakespeare-char.yaml", [override])
    assert says in str(e.value)


def test_base_recipe_and_cli_override_precedence(tmp_path: Path):
    (tmp_path / "parent.yaml").write_text(
        "model: {n_layers: 3, d_model: 64, n_heads: 4}\ntraining: {iters: 7}\n"
        "data: {prefix: p, tokenizer: {model: t}}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nmodel: {n_layers: 5}\n")
    cfg = load_config(tmp_path / "child.yaml", ["training.iters=9"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.training.iters) == (5, 64, 9)


def test_base_loop_is_reported(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")


def test_resolved_config_is_frozen():
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml")
    with pytest.raises(Exception, match="cannot assign"):
        cfg.model.n_layers = 1  # type: ignore[misc]


def test_deepspeed_passthrough_and_section_errors():
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml",
                      ["deepspeed.zero_optimization.reduce_bucket_size=1000"])
    assert cfg.deepspeed == {"zero_optimization": {"reduce_bucket_size": 1000}}
    with pytest.raises(ConfigError, match="is a section"):
        load_config(REPO / "recipes/shakespeare-char.yaml", ["model=3"])



def _deepspeed_accepts(block: dict) -> bool:
    """Whether the installed DeepSpeed's config parser takes ``block`` (with a batch size)."""
    from deepspeed import DeepSpeedConfig

    try:
        DeepSpeedConfig({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, **block})
    except Exception:
        return False
    return True


def test_deepspeed_sections_are_every_section_the_installed_deepspeed_reads_as_a_mapping():
    """DEEPSPEED_SECTIONS is a list by hand (config loading does not import DeepSpeed); this
    derives it from the installed release, so a section DeepSpeed adds fails here instead of as
    a TypeError from inside deepspeed.initialize. Candidates: every identifier-like string in
    the modules DeepSpeed's config parser imports; a section is one whose parser takes ``{}``
    but refuses a boolean or a number (deepspeed.timers=false, deepspeed.compile=true)."""
    import logging
    import sys

    import deepspeed
    import deepspeed.runtime.config  # noqa: F401  (loads every module the parser reads keys in)
    from packaging.version import Version

    from megatron_lite.config.deepspeed_block import DEEPSPEED_SECTIONS

    candidates: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] != "deepspeed" or not path or not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"[a-z][a-z0-9_]*", node.value):
                candidates.add(node.value)
    quiet = logging.getLogger("DeepSpeed")
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        sections = {key for key in candidates - {"train_batch_size", "train_micro_batch_size_per_gpu"}
                    if _deepspeed_accepts({key: {}})
                    and not all(_deepspeed_accepts({key: v}) for v in (True, False, 1, 0))}
        listed = set(DEEPSPEED_SECTIONS)
        # The engine refuses these in any form: the recipe builds the optimizer and schedule.
        missing = sections - listed - {"optimizer", "scheduler"}
        assert not missing, f"add to config/deepspeed_block.py DEEPSPEED_SECTIONS: {sorted(missing)}"
        for dotted in listed - sections:
            *parents, leaf = dotted.split(".")
            block: dict = {}
            node = block
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = {}
            # A nested section, or one this release removed (refused whatever its value). An
            # older release (the floor, 0.16) ignores sections it does not know yet, whatever
            # their value: indistinguishable from a scalar from here, so checked on 0.19 and up.
            if _deepspeed_accepts(block) and Version(deepspeed.__version__) >= Version("0.19"):
                node[leaf] = False
                assert not _deepspeed_accepts(block), f"DeepSpeed reads deepspeed.{dotted} as a scalar"
    finally:
        quiet.level = level


@pytest.mark.parametrize("override", ["deepspeed.timers=false", "deepspeed.torch_autocast=true",
                                      "deepspeed.compile=true", "deepspeed.tensor_parallel=1"])
def test_a_deepspeed_section_given_a_scalar_is_a_config_problem(override):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"'{key}' = {value.title()} must be a mapping"):
        load_config(REPO / "recipes/shakespeare-char.yaml", [override])

def test_malformed_override():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(REPO / "recipes/shakespeare-char.yaml", ["training.iters"])


def test_every_field_has_a_docstring_and_docs_are_current():
    import dataclasses

    from megatron_lite.config import schema
    from megatron_lite.config.docs import field_docs, markdown

    for name, cls in vars(schema).items():
        if dataclasses.is_dataclass(cls) and name.endswith("Config"):
            missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
            assert not missing, f"{name}: fields without a docstring: {missing}"
    assert (REPO / "docs/config.md").read_text() == markdown(), \
        "docs/config.md is stale: python -m megatron_lite.config.docs > docs/config.md"


def test_spike_settings_are_checked_together():
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "recipes/shakespeare-char.yaml", [
            "spikes.policy=rollback", "spikes.window=0", "spikes.rollback.skip_batches=-1",
            "spikes.nonfinite_policy=ignore"])
    text = str(e.value)
    assert "'spikes.policy' = 'rollback' reloads checkpoints: set 'checkpoint.dir'" in text
    assert "'spikes.window' = 0" in text and "'spikes.rollback.skip_batches' = -1" in text
    assert "'spikes.nonfinite_policy' = 'ignore'" in text and "'skip_step'" in text


@pytest.mark.parametrize("first, says", [
    ("training.iters=5", "the first argument is the recipe; 'training.iters=5' is an override: "
                         "python pretrain.py recipes/NAME.yaml training.iters=5"),
    ("recipes/shakespeare_char.yaml", "recipe file 'recipes/shakespeare_char.yaml' does not exist; "
                                      "did you mean recipes/shakespeare-char.yaml?"),
])
def test_a_forgotten_or_misspelt_recipe_says_what_to_run(first, says):
    with pytest.raises(ConfigError) as e:
        load_config(first, [])
    assert says in str(e.value)
