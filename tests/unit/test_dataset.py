import numpy as np
import pytest

from megatron_lite.data.gpt_dataset import GlobalBatchSampler, StreamDataset, token_splits
from megatron_lite.data.indexed import IndexedDatasetWriter


@pytest.fixture()
def prefix(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.int32)
    # Documents of varied lengths; token value = its position in the stream.
    lengths = [7, 30, 3, 50, 11, 19]
    start = 0
    for n in lengths:
        w.add_documents([np.arange(start, start + n)])
        start += n
    w.finalize()
    return str(tmp_path / "d")


def test_samples_are_contiguous_windows_across_documents(prefix):
    train, valid, _ = token_splits(prefix, 8, (0.8, 0.2, 0.0), 0)
    ds = StreamDataset(train)
    for i in range(3 * len(ds)):  # three epochs
        s = ds[i].numpy()
        assert s.size == 9 and np.all(np.diff(s) == 1)  # the stream itself
        assert s[-1] < train.end
    starts = {ds.start_of(i) for i in range(len(ds))}
    assert len(starts) == len(ds)  # an epoch never repeats a window
    v = StreamDataset(valid)
    assert all(v[i][0].item() >= train.end for i in range(len(v)))
    _, valid, test = token_splits(prefix, 4, (0.6, 0.2, 0.2), 0)
    t = StreamDataset(test)
    assert len(t) > 0 and all(t[i][0].item() >= valid.end for i in range(len(t)))


def test_epochs_reshuffle_and_shift_the_grid(prefix):
    train, _, _ = token_splits(prefix, 8, (0.8, 0.2, 0.0), 0)
    ds = StreamDataset(train)
    n = len(ds)
    e0 = [ds.start_of(i) for i in range(n)]
    e1 = [ds.start_of(n + i) for i in range(n)]
    assert e0 != e1 and sorted(e0) != sorted(e1)


def test_sampler_resumes_and_splits_the_global_batch():
    def take(sampler, k):
        it = iter(sampler)
        return [next(it) for _ in range(k)]

    full = take(GlobalBatchSampler(0, 8, 2, 0, 1), 8)  # 2 steps of 4 micro-batches
    resumed = take(GlobalBatchSampler(8, 8, 2, 0, 1), 4)
    assert resumed == full[4:]
    r0 = take(GlobalBatchSampler(0, 8, 2, 0, 2), 2)
    r1 = take(GlobalBatchSampler(0, 8, 2, 1, 2), 2)
    assert sorted(sum(r0 + r1, [])) == list(range(8))
    with pytest.raises(ValueError, match="not a multiple"):
        GlobalBatchSampler(0, 6, 4, 0, 1)


def test_too_little_data_is_a_clear_error(prefix):
    train, _, _ = token_splits(prefix, 200, (0.8, 0.2, 0.0), 0)
    with pytest.raises(ValueError, match="seq_length"):
        StreamDataset(train)
