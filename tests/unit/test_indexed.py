import struct

import numpy as np
import pytest

from megatron_lite.data.indexed import IndexedDataset, IndexedDatasetWriter, dataset_exists


def test_round_trip_and_megatron_layout(tmp_path):
    docs = [[5, 6, 7], [1], [2, 3, 4, 9]]
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_documents(docs[:2])
    w.add_documents(docs[2:])
    w.finalize()
    ds = IndexedDataset(tmp_path / "d")
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    # The bytes Megatron-LM's MMIDIDXReader expects, written out by hand from its spec.
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", 3) + struct.pack("<Q", 4)
                + struct.pack("<3i", 3, 1, 4) + struct.pack("<3q", 0, 6, 8) + struct.pack("<4q", 0, 1, 2, 3))
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<8H", 5, 6, 7, 1, 2, 3, 4, 9)
    # ... and a pair built by hand from the specification reads back as those documents.
    (tmp_path / "hand.idx").write_bytes(expected)
    (tmp_path / "hand.bin").write_bytes(struct.pack("<8H", 5, 6, 7, 1, 2, 3, 4, 9))
    hand = IndexedDataset(tmp_path / "hand")
    assert [hand[i].tolist() for i in range(len(hand))] == docs and hand.dtype == np.uint16


def test_aborted_write_leaves_nothing_that_looks_valid(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_documents([[1, 2]])
    w.abort()
    assert not dataset_exists(tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


def test_truncated_bin_is_detected(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.int32)
    w.add_documents([[1, 2, 3], [4, 5]])
    w.finalize()
    data = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="inconsistent"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("keep", [20, 100])  # inside the header; inside the arrays
def test_truncated_idx_names_its_file(tmp_path, keep):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_documents([[1, 2, 3]] * 20)
    w.finalize()
    idx = tmp_path / "d.idx"
    idx.write_bytes(idx.read_bytes()[:keep])
    with pytest.raises(ValueError, match=rf"'{tmp_path}/d.idx' is truncated .*rebuild it"):
        IndexedDataset(tmp_path / "d")


def test_sampled_max_id_sees_ids_anywhere_in_a_large_dataset(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    tokens = np.full(5_000_000, 7, np.uint16)
    tokens[-3] = 499  # in the last window
    w.add_flat(tokens, np.array([tokens.size], np.int32))
    w.finalize()
    assert IndexedDataset(tmp_path / "d").sampled_max_id() == 499


def test_missing_dataset_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        IndexedDataset(tmp_path / "nope")


def test_merge_keeps_the_document_structure_of_sentence_split_datasets(tmp_path):
    """A Megatron --split-sentences dataset: several sequences (sentences) per document, its
    doc_idx says where documents end. Merging shifts and keeps those boundaries."""
    from megatron_lite.data.indexed import merge

    a = IndexedDatasetWriter(tmp_path / "a", np.uint16)
    a.add_documents([[1, 2], [3], [4, 5, 6], [7], [8, 9]])  # 2 documents: sentences 0-2, 3-4
    a.finalize(doc_idx=np.array([0, 3, 5]))
    b = IndexedDatasetWriter(tmp_path / "b", np.uint16)
    b.add_documents([[10], [11, 12], [13]])  # one sentence per document
    b.finalize()
    assert merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab")) == (5, 13)
    ab = IndexedDataset(tmp_path / "ab")
    assert ab.doc_idx.tolist() == [0, 3, 5, 6, 7, 8] and ab.n_documents == 5 and len(ab) == 8
    assert [ab[i].tolist() for i in range(len(ab))] == [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10],
                                                          [11, 12], [13]]


def test_inconsistent_document_boundaries_are_refused(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_documents([[1], [2], [3]])
    with pytest.raises(ValueError, match="must run from 0 to the 3 sequences"):
        w.finalize(doc_idx=np.array([0, 2]))
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_documents([[1], [2], [3]])
    w.finalize(doc_idx=np.array([0, 2, 3]))
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    idx[-16:-8] = struct.pack("<q", 7)  # the middle boundary past the end
    (tmp_path / "d.idx").write_bytes(bytes(idx))
    with pytest.raises(ValueError, match="d.idx': its document boundaries are inconsistent"):
        IndexedDataset(tmp_path / "d")
