"""Validation loss and a text sample, at ``training.eval_interval`` and at the last step."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from megatron_lite.config.schema import Config
from megatron_lite.data.gpt_dataset import GlobalBatchSampler
from megatron_lite.data.source import DataSource
from megatron_lite.distributed.collectives import (
    CollectiveError,
    first_line,
    mean_over_ranks,
    on_every_rank,
    raise_together,
)
from megatron_lite.distributed.device import compiles_per_shape
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.logging import MetricsLogger
from megatron_lite.training.build import Components
from megatron_lite.training.generate import sample
from megatron_lite.training.step import StepRunner


class _Unpadded(nn.Module):
    """The model's logits over the tokenizer's ids only: the rows past them pad the vocabulary
    for tensor parallelism, and scores are the exported model's (which has none)."""

    def __init__(self, model: nn.Module, vocab: int):
        super().__init__()
        self.inner, self.vocab = model, vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)[..., :self.vocab]


class Evaluator:
    def __init__(self, cfg: Config, dims: ParallelDims, parts: Components, runner: StepRunner,
                 data: DataSource, logger: MetricsLogger, log: Callable[[str], None]):
        """``runner``: the trainer's step runner (evaluation batches go through it too)."""
        self.cfg, self.dims, self.parts, self.runner, self.data = cfg, dims, parts, runner, data
        self.logger, self.log = logger, log

    def due(self, step: int, last: bool) -> bool:
        interval = self.cfg.training.eval_interval
        return bool(interval and step % interval == 0) or last

    def maybe_run(self, step: int, consumed_samples: int, last: bool) -> tuple[float, str | None] | None:
        """Collective: at the interval or the last step, the validation loss (logged, with a
        sample) and the sample's text; None at other steps."""
        if not self.due(step, last):
            return None
        start = time.perf_counter()
        val = self.loss(self.data.valid)
        # Each blend entry's alone (Megatron reports one loss per validation set), and the test
        # split once, at the end.
        own = {f"val_loss/{name}": self.loss(dataset) for name, dataset in self.data.valid_sets.items()}
        if last and self.data.test is not None:
            own["test_loss"] = self.loss(self.data.test)
        try:
            text = self.sample()
        except CollectiveError:
            raise  # the ranks no longer agree: training cannot go on either
        except Exception as e:  # a sample is for reading; it never fails a run
            text = None
            self.log(f"warning: sampling at step {step} failed ({type(e).__name__}: {first_line(e)}); "
                     "training goes on")
        record = {"step": step, "val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **own,
                  "consumed_samples": consumed_samples, "eval_ms": 1000.0 * (time.perf_counter() - start)}
        self.logger.log(record)
        self.log(f"eval step {step}: val_loss {val:.4f} | val_ppl {record['val_ppl']:.2f}"
                 + "".join(f" | {key} {value:.4f}" for key, value in own.items()))
        if text is not None:
            self.logger.text("sample", text, step)
            self.log(f"sample at step {step}:\n{text}\n" + "-" * 40)
        return val, text

    def maybe_score_tasks(self, step: int, last: bool) -> dict[str, float] | None:
        """Collective: at ``eval.harness_interval`` and the last step, the scores of
        ``eval.harness_tasks`` (logged); None at other steps. Every rank runs the same requests
        (the model's layers may hold parts of it: each forward is collective); the scores are
        the same everywhere."""
        ev = self.cfg.eval
        if not ev.harness_tasks or not (last or (ev.harness_interval and step % ev.harness_interval == 0)):
            return None
        from megatron_lite.evaluation import evaluate_tasks

        start = time.perf_counter()
        model = _Unpadded(self.parts.engine.module, self.data.tokenizer.vocab_size)
        scores = on_every_rank(lambda: evaluate_tasks(
            model, self.data.tokenizer, list(ev.harness_tasks), ev.harness_limit,
            self.parts.model_cfg.max_seq_len, self.parts.device, ev.harness_include_path,
            ev.harness_batch_size), self.dims, "the downstream tasks (eval.harness_tasks)")
        self.logger.log({"step": step, **scores, "harness_ms": 1000.0 * (time.perf_counter() - start)})
        self.log(f"tasks at step {step}: " + " | ".join(f"{k.removeprefix('harness/')} {v:.4f}"
                                                        for k, v in scores.items()))
        return scores

    @torch.no_grad()
    def loss(self, valid) -> float:
        """The mean loss over ``training.eval_iters`` global batches from the start of the
        dataset ``valid`` (a validation or test split: the same batches at every evaluation)."""
        cfg, engine, device = self.cfg, self.parts.engine, self.parts.device
        sampler = GlobalBatchSampler(0, self.dims.global_batch(cfg), cfg.training.micro_batch_size,
                                     self.dims.dp_rank, self.dims.data, wrap=len(valid))
        batches = (torch.stack([valid[i] for i in idx]) for idx in sampler)
        engine.eval()
        total = torch.zeros((), device=device)
        n = cfg.training.eval_iters
        try:
            for _ in range(n):
                total += self.runner.eval_loss(batches, device)
        finally:  # dropout and activation checkpointing come back whatever happened
            engine.train()
        return mean_over_ranks((total / n).item(), self.dims, "the validation loss")

    def sample(self) -> str | None:
        t = self.cfg.training
        if not t.sample_prompt or t.sample_tokens <= 0:
            return None
        p = self.cfg.parallel
        if p.pipeline > 1 or p.ulysses > 1 or p.context > 1 or (p.sequence_parallel and p.tensor > 1):
            return None  # generation runs whole prompts through one model replica
        tok = self.data.tokenizer
        prompt = on_every_rank(lambda: list(tok.encode(t.sample_prompt)), self.dims,
                               "encoding the sample prompt")
        model = self.parts.engine.module
        was_training = model.training
        model.eval()
        try:
            ids = sample(model, prompt, t.sample_tokens, self.cfg.data.seq_length, t.sample_temperature,
                         t.sample_top_k, t.seed, self.parts.device,
                         agree=lambda error: raise_together(error, self.dims, "the text sample"),
                         fixed_shape=compiles_per_shape(self.parts.acc),
                         after_token=self.runner.graph_break)
        finally:  # a failed sample must not leave the rest of the run without dropout
            model.train(was_training)
        return t.sample_prompt + tok.decode(ids)
