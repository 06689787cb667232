"""Attention within documents (``model.attention_mask=document``): a sample that packs
documents trains each as if it were alone. Per token, the packed samples' losses equal those of
each document run alone (positions restarting at each document, RoPE and learned), and differ
from plain causal attention over the pack; under ring attention (context 2), Ulysses 2 and
both, each rank's losses and the sum of the ranks' gradients equal one process's. With
``data.eod_mask_loss`` the loss is the mean over the predictions not made at an EOD token, in
every layout."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO, run_worker_script

WORKER = REPO / "tests/distributed/document_mask_worker.py"
LAYOUTS = {
    "context2": (2, ["parallel.context=2"]),
    "ulysses2": (2, ["parallel.ulysses=2"]),
    "context2xulysses2": (4, ["parallel.context=2", "parallel.ulysses=2"]),
    # The vocabulary-parallel loss; the gradients are slices there (compared in test_layouts).
    "tensor2-sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
}


def run_worker(out, nproc: int, overrides: list[str]) -> list[dict]:
    run_worker_script(WORKER, out, nproc, overrides)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("documents-ref"), 1, [])[0]


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_packed_documents_have_the_losses_of_each_document_alone(reference, variant):
    result = reference[variant]
    packed = result["losses"]  # (B, T)
    for row, (spans, alone) in enumerate(zip(result["spans"], result["alone"], strict=True)):
        assert len(spans) > 1
        for (start, end), losses in zip(spans, alone, strict=True):
            torch.testing.assert_close(packed[row, start:end], losses, rtol=1e-5, atol=1e-5,
                                       msg=f"row {row}, document at {start}:{end}")
    # Plain causal attention over the pack is another function (the test would see a mask lost).
    assert (result["causal"] - packed).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_eod_mask_loss_leaves_the_predictions_made_at_eod_out_of_the_mean(reference, variant):
    result = reference[variant]
    at_eod = torch.zeros_like(result["losses"], dtype=torch.bool)
    for row, spans in enumerate(result["spans"]):
        for _, end in spans[:-1]:
            at_eod[row, end - 1] = True  # a document's last input is its EOD
    assert at_eod.sum() == 3
    want = result["losses"][~at_eod].mean().item()
    assert result["eod_masked_loss"] == pytest.approx(want, rel=1e-5)
    assert abs(result["losses"].mean().item() - want) > 1e-3  # the mask changes the mean


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_document_attention_under_sequence_parallelism_matches_one_process(tmp_path, reference, layout):
    nproc, overrides = LAYOUTS[layout]
    ranks = run_worker(tmp_path, nproc, overrides)
    for variant, want in reference.items():
        losses = torch.full_like(want["losses"], float("nan"))
        for rank in ranks:  # each rank's tokens, placed at their positions
            losses[:, rank[variant]["held"]] = rank[variant]["losses"]
        torch.testing.assert_close(losses, want["losses"], rtol=1e-5, atol=1e-6, msg=f"{variant} losses")
        for name, grad in want["grads"].items() if "tensor" not in layout else ():
            # Each rank's gradient is its tokens' share (the run sums them over the ranks).
            total = sum(rank[variant]["grads"][name] for rank in ranks)
            torch.testing.assert_close(total, grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item() + 1e-8,
                                       msg=f"{variant} gradient of {name}")
        for rank in ranks:  # every rank has the loss of the whole sequence
            assert rank[variant]["eod_masked_loss"] == pytest.approx(want["eod_masked_loss"], rel=1e-5)


def test_pipeline_stages_take_each_micro_batch_s_documents(tmp_path):
    """Under pipeline parallelism (with Ulysses, and the loss mask) a stage receives only the
    previous stage's output; the documents come beside it: the run trains as one process does
    (layout_worker.py: losses, gradient norms and weights after 5 steps)."""
    from tests.distributed.test_layouts import assert_matches
    from tests.distributed.test_layouts import run_worker as run_layout

    documents = ["model.attention_mask=document", "model.eod_id=3", "data.eod_mask_loss=true"]
    reference = run_layout(tmp_path / "one", 1, documents)[0]
    ranks = run_layout(tmp_path / "pp2xulysses2", 4, ["parallel.pipeline=2", "parallel.ulysses=2",
                                                      "parallel.zero_stage=1", *documents])
    assert_matches(reference, ranks)
