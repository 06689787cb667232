"""Attention within documents (``model.attention_mask=document``) on packed samples, for a
small GPT (learned positions) and a small Llama (RoPE, GQA, qk-norm, selective
recomputation): this rank's per-token
losses (from the logits of the tokens it holds) and its gradients of their sum, written to
OUT/rank{R}.pt, and the model's mean loss with the predictions at EOD left out
(``data.eod_mask_loss``). One process also writes the losses of each document run alone (no documents
given) and of the packed samples under plain causal attention. Run by test_document_mask.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/document_mask_worker.py OUT \
        parallel.context=2
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megatron_lite.config import load_config
from megatron_lite.distributed import detect, init_distributed
from megatron_lite.distributed.shard_spec import spec
from megatron_lite.distributed.startup import shutdown_distributed
from megatron_lite.model import resolve_model
from megatron_lite.parallel import build_parallel_model
from megatron_lite.parallel.apply import use_loss_mask
from megatron_lite.parallel.ring import sequence_positions
from megatron_lite.training.step import StepRunner

REPO = Path(__file__).resolve().parents[2]
VOCAB, EOD, SEQ = 64, 0, 32
# The documents of each row: their lengths, each ending with EOD but the last (cut by the
# window). They cross the ring's chunks (8 tokens at context 2) and the Ulysses slices.
DOCUMENTS = [(13, 20), (5, 15, 13)]
COMMON = ["model.n_layers=2", "model.d_model=64", "model.vocab_multiple=1", f"model.vocab_size={VOCAB}",
          f"model.eod_id={EOD}", "model.attention_mask=document", f"data.seq_length={SEQ}",
          "training.micro_batch_size=2", "training.global_batch_size=2"]
VARIANTS = {
    "gpt": ["model.n_heads=4"],
    "llama": ["model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
              "model.n_heads=8", "model.n_kv_heads=4", "model.qk_norm=true",
              "model.activation_checkpointing=selective"],
}


def packed_batch() -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """(2, SEQ+1) token windows (ids 1.. except each document's last token, EOD) and, per row,
    the (start, end) of each document's inputs."""
    gen = torch.Generator().manual_seed(0)
    rows, spans = [], []
    for lengths in DOCUMENTS:
        assert sum(lengths) == SEQ + 1
        row, row_spans, start = [], [], 0
        for i, n in enumerate(lengths):
            doc = torch.randint(1, VOCAB, (n,), generator=gen)
            if i < len(lengths) - 1:
                doc[-1] = EOD
            row.append(doc)
            row_spans.append((start, min(start + n, SEQ)))
            start += n
        rows.append(torch.cat(row))
        spans.append(row_spans)
    return torch.stack(rows), spans


def per_token(model, inputs, targets, documents=None) -> torch.Tensor:
    logits = model(inputs, None, documents)  # (B, T held, V)
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return losses.view(targets.shape)


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    results = {}
    batch, spans = packed_batch()
    for variant, extra in VARIANTS.items():
        cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [*COMMON, *extra, *overrides])
        if not results:
            dims, _ = init_distributed(cfg, detect())
        model = build_parallel_model(resolve_model(cfg.model, None, SEQ, dims.tensor), dims, "cpu", 1234)
        # The run's own split of a batch (the engine is not needed for it).
        runner = StepRunner(cfg, dims, SimpleNamespace(module=model), 1, document_end=EOD)
        inputs, targets, documents = runner.split(batch)
        losses = per_token(model, inputs, targets, documents)
        losses.sum().backward()
        held = sequence_positions(SEQ, dims.ulysses, dims.ulysses_rank, dims.context, dims.context_rank)
        result = {"held": held, "losses": losses.detach(),
                  "grads": {spec(p).name: p.grad.clone() for p in model.parameters()}}
        # data.eod_mask_loss: the model's own mean loss, the predictions made at EOD left out.
        use_loss_mask(model)
        masking = StepRunner(cfg, dims, SimpleNamespace(module=model), 1, document_end=EOD, loss_mask_end=EOD)
        with torch.no_grad():
            result["eod_masked_loss"] = model(*masking.split(batch)).item()
        if dims.world_size == 1:
            with torch.no_grad():
                result["causal"] = per_token(model, batch[:, :-1], batch[:, 1:])
                result["alone"] = [[per_token(model, batch[r:r + 1, a:b], batch[r:r + 1, a + 1:b + 1])[0]
                                    for a, b in row] for r, row in enumerate(spans)]
                result["spans"] = spans
        results[variant] = result
    torch.save(results, out / f"rank{dims.rank}.pt")
    shutdown_distributed(dims)


if __name__ == "__main__":
    main()
