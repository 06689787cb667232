import numpy as np
import pytest

from megatron_lite.config import ConfigError, load_config
from megatron_lite.config.validate import split_shares
from megatron_lite.data.blend import blend_order
from megatron_lite.data.gpt_dataset import split_bounds
from tests.conftest import REPO


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [0.91, 0.06, 0.03]])
def test_blend_within_one_sample_at_every_prefix(weights):
    n = 5000
    which, nth = blend_order(weights, n)
    w = np.asarray(weights) / sum(weights)
    counts = np.zeros((n, len(w)))
    counts[np.arange(n), which] = 1
    realised = np.cumsum(counts, axis=0)
    ideal = np.outer(np.arange(1, n + 1), w)
    assert np.abs(realised - ideal).max() <= 1.0
    for k in range(len(w)):  # each dataset's samples are taken in order, none twice
        assert nth[which == k].tolist() == list(range(int((which == k).sum())))


def test_split_strings_and_bounds():
    assert split_shares("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert split_shares("90,10") == pytest.approx((0.9, 0.1, 0.0))
    assert split_bounds(1000, split_shares("969,30,1")) == [0, 969, 999, 1000]
    assert split_bounds(42, split_shares("95,5,0")) == [0, 40, 42, 42]
    with pytest.raises(ValueError):
        split_shares("a,b")


def test_blend_recipe_keys(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "base: " + str(REPO / "recipes/quickstart.yaml") + "\n"
        "data:\n  prefix: null\n  blend:\n    - {prefix: a_text_document, weight: 0.7}\n"
        "    - {prefix: b_text_document, weight: 0.3}\n")
    cfg = load_config(recipe)
    got = [(e.prefix, e.weight) for e in cfg.data.blend]
    assert got == [("a_text_document", 0.7), ("b_text_document", 0.3)]
    with pytest.raises(ConfigError, match="exactly one of 'data.prefix'"):
        load_config(recipe, ["data.prefix=c_text_document"])
    with pytest.raises(ConfigError, match="data.split"):
        load_config(recipe, ["data.split=0,1,0"])


def test_blend_order_is_cached(tmp_path):
    from megatron_lite.data.blend import cached_blend_order

    with pytest.raises(FileNotFoundError, match="cache_shared"):
        cached_blend_order([0.6, 0.4], 100, tmp_path, build=False)
    which, nth = cached_blend_order([0.6, 0.4], 100, tmp_path, build=True)
    again = cached_blend_order([0.6, 0.4], 100, tmp_path, build=False)
    expected = blend_order([0.6, 0.4], 100)
    for got in (which, again[0]):
        np.testing.assert_array_equal(got, expected[0])
    np.testing.assert_array_equal(again[1], expected[1])


def test_each_blend_entry_is_reported_under_its_name():
    from megatron_lite.config.schema import BlendEntry, DataConfig
    from megatron_lite.data.source import blend_names

    cfg = DataConfig(blend=[BlendEntry("/d/web_text_document"), BlendEntry("/e/web_text_document"),
                            BlendEntry("/d/code_text_document", name="code")])
    assert blend_names(cfg) == ["web_text_document.0", "web_text_document.1", "code"]


def test_a_blend_serves_the_same_first_samples_whatever_the_run_length(tmp_path):
    """Raising training.iters (or the batch size) at a resume plans more samples: the ones a
    run has read, and the ones it reads next, stay the same in every dataset of a blend."""
    from megatron_lite.config.schema import BlendEntry, DataConfig, TokenizerConfig
    from megatron_lite.data.indexed import IndexedDatasetWriter
    from megatron_lite.data.source import build_data

    rng = np.random.default_rng(0)
    (tmp_path / "chars.json").write_text('["a", "b", "c", "d"]')
    entries = []
    for name, docs, weight in (("web", 40, 0.7), ("code", 25, 0.3)):
        w = IndexedDatasetWriter(tmp_path / f"{name}_text_document", np.int32)
        for n in rng.integers(3, 30, docs):
            w.add_documents([rng.integers(0, 4, n)])
        w.finalize()
        entries.append(BlendEntry(str(tmp_path / f"{name}_text_document"), weight=weight))
    cfg = DataConfig(prefix=None, blend=entries, seq_length=8, split="90,10,0",
                     tokenizer=TokenizerConfig(type="char", model=str(tmp_path / "chars.json")))

    def first(n: int, k: int) -> list[list[int]]:
        train = build_data(cfg, n, 8).train
        return [train[i].tolist() for i in range(k)]

    short = first(120, 120)  # a run of 10 steps of 12 samples: several epochs of each dataset
    assert first(1200, 120) == short
    assert first(121, 120) == short
