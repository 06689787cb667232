import os

import numpy as np
import pytest

from megatron_lite.data.gpt_index import IndexSpec, build_indices, get_indices, sample_tokens
from megatron_lite.data.indexed import IndexedDataset, IndexedDatasetWriter


@pytest.fixture()
def dataset(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 60)  # includes empty documents
    w = IndexedDatasetWriter(tmp_path / "d", np.int32)
    start = 0
    for n in lengths:
        w.add_documents([np.arange(start, start + n)])  # token value = position in the file
        start += n
    w.finalize()
    return str(tmp_path / "d")


def _reference_stream(ds: IndexedDataset, doc_index: np.ndarray) -> np.ndarray:
    return np.concatenate([ds[int(d)] for d in doc_index])


@pytest.mark.parametrize("seq, samples, begin, end", [(8, 50, 0, 60), (16, 400, 10, 50), (5, 3, 0, 2)])
def test_samples_match_the_shuffled_document_stream(dataset, seq, samples, begin, end):
    ds = IndexedDataset(dataset)
    if ds.lengths[begin:end].sum() == 0:
        pytest.fail("fixture produced an empty split")
    spec = IndexSpec(dataset, begin, end, seq, samples, seed=3)
    idx = build_indices(ds.lengths, spec)
    doc_index = idx["document"]
    n = end - begin
    assert doc_index.size % n == 0
    for epoch in doc_index.reshape(-1, n):  # every document exactly once per epoch
        assert sorted(epoch.tolist()) == list(range(begin, end))
    stream = _reference_stream(ds, doc_index)
    pointers_tok = ds.pointers // ds.dtype.itemsize
    served = idx["shuffle"].tolist()  # distinct samples of whole blocks (an epoch's worth each)
    assert len(set(served)) == samples and max(served) < len(idx["sample"]) - 1
    for i in range(samples):
        j = int(idx["shuffle"][i])
        got = sample_tokens(ds.tokens, pointers_tok, ds.lengths, idx, i, seq)
        np.testing.assert_array_equal(got, stream[j * seq:j * seq + seq + 1])


def test_cache_rebuilds_on_any_change_and_detects_damage(dataset, tmp_path):
    ds = IndexedDataset(dataset)
    cache = tmp_path / "cache"
    spec = IndexSpec(dataset, 0, 60, 8, 50, seed=1)
    first, built = get_indices(ds.lengths, spec, cache)
    assert built
    again, built = get_indices(ds.lengths, spec, cache)
    assert not built
    np.testing.assert_array_equal(again["sample"], first["sample"])
    for changed in (IndexSpec(dataset, 0, 60, 9, 50, 1), IndexSpec(dataset, 0, 60, 8, 50, 2),
                    IndexSpec(dataset, 0, 50, 8, 50, 1), IndexSpec(dataset, 0, 60, 8, 400, 1)):
        assert get_indices(ds.lengths, changed, cache)[1], changed
    # More samples within the same epoch's block (a resume with more steps): the same entry.
    longer, built = get_indices(ds.lengths, IndexSpec(dataset, 0, 60, 8, 51, 1), cache)
    assert not built and len(longer["shuffle"]) == 51
    np.testing.assert_array_equal(longer["shuffle"][:50], first["shuffle"])
    # The data file changes (new modification time): rebuilt.
    st = os.stat(dataset + ".bin")
    os.utime(dataset + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert get_indices(ds.lengths, spec, cache)[1]
    assert not get_indices(ds.lengths, spec, cache)[1]
    # Truncated or tampered files are detected and rebuilt.
    sample_file = next(cache.glob("*-sample.npy"))
    for damage in ("truncate", "flip"):
        newest = max(cache.glob("*-sample.npy"), key=lambda p: p.stat().st_mtime_ns)
        data = bytearray(newest.read_bytes())
        if damage == "truncate":
            newest.write_bytes(bytes(data[:-8]))
        else:
            data[-1] ^= 0xFF
            newest.write_bytes(bytes(data))
        arrays, built = get_indices(ds.lengths, spec, cache)
        assert built, damage
        np.testing.assert_array_equal(arrays["sample"], build_indices(ds.lengths, spec)["sample"])
    assert sample_file.exists()


def test_more_samples_extend_the_same_document_order(dataset):
    ds = IndexedDataset(dataset)
    small = build_indices(ds.lengths, IndexSpec(dataset, 0, 60, 8, 50, seed=5))
    large = build_indices(ds.lengths, IndexSpec(dataset, 0, 60, 8, 400, seed=5))
    n = small["document"].size
    np.testing.assert_array_equal(large["document"][:n], small["document"])
    np.testing.assert_array_equal(large["sample"][:len(small["sample"])], small["sample"])


@pytest.mark.parametrize("begin, end", [(0, 60), (10, 12)])
def test_the_samples_served_first_do_not_depend_on_how_many_are_asked_for(dataset, begin, end):
    """A run resumed with more steps (or another batch size) must read on where it stopped:
    sample i is the same whether 37, 50 or 400 samples are planned (several epochs of the
    second split)."""
    ds = IndexedDataset(dataset)
    pointers_tok = ds.pointers // ds.dtype.itemsize

    def served(n: int) -> list[list[int]]:
        idx = build_indices(ds.lengths, IndexSpec(dataset, begin, end, 8, n, seed=5))
        return [sample_tokens(ds.tokens, pointers_tok, ds.lengths, idx, i, 8).tolist() for i in range(n)]

    longest = served(400)
    for n in (1, 37, 50):
        assert served(n) == longest[:n], n
    per_block = int(ds.lengths[begin:end].sum()) // 8
    for b in range(len(longest) // per_block):  # no sample twice within an epoch's worth
        block = [tuple(t) for t in longest[b * per_block:(b + 1) * per_block]]
        assert len(set(block)) == per_block
