"""``checkpoint.init_from``: a run's first weights from another model (a checkpoint of this
project or a Hugging Face directory), with nothing else of it: step 0, a fresh optimizer and
schedule, data from the start (torchtitan's ``initial_load_model_only``, Megatron's
``--finetune --no-load-optim --no-load-rng``).

Each rank reads the weights on the host as ``materialize`` asks for them, parameter by
parameter, and copies its slice of each, so every layout (tensor, pipeline, ZeRO-3, HSDP,
tiling) starts from them exactly as it starts from the seeded initial values. A Hugging Face
source is read one block at a time (``hf_source``: a rank holds one block of it, a pipeline stage
reads only its own blocks); a checkpoint of this project one parameter at a time, assembled from
its memory-mapped rank files (``convert.open_model``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lite.checkpoint import store
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.collectives import first_line
from megatron_lite.model import build_model
from megatron_lite.model.transformer import VOCAB_PARAMETERS

# Fields that change what the same weights compute without changing their shapes. A source
# that differs from the run in one of these would train silently on another model, so the
# difference is refused; RoPE's base and scaling are the exception: changing them on purpose is
# how a context is extended (a larger rope_theta, llama3 scaling), so they are only reported.
SAME_REQUIRED = ("activation", "norm", "position", "norm_eps", "bias", "qkv_bias", "qk_norm",
                 "tie_embeddings", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
MAY_CHANGE = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_len", "max_seq_len")


class InitFromError(ValueError):
    """``checkpoint.init_from`` names no model, or one whose weights this run's model cannot take."""


class SourceReadError(OSError):
    """A weight of ``checkpoint.init_from`` could not be read while the model was built (the
    files were checked when opened: a disk error, a file cut short since). This rank's own."""


@dataclass
class InitialWeights:
    """The source's full weights by plain-model name (read when asked for, where the source
    allows)."""

    weights: Mapping[str, torch.Tensor]
    path: str = ""
    """The source, as ``checkpoint.init_from`` gives it (for errors)."""

    def value(self, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The full initial value of parameter ``name`` of ``shape``: the source's, its
        vocabulary rows padded with zeros to the run's padded vocabulary."""
        from safetensors import SafetensorError  # transformers' (read only with a Hugging Face source)

        try:
            w = self.weights[name]
        except (OSError, RuntimeError, SafetensorError) as e:
            raise SourceReadError(f"checkpoint.init_from={self.path!r}: reading {name} failed: "
                                  f"{type(e).__name__}: {e}") from None
        if name in VOCAB_PARAMETERS and w.shape[0] < shape[0]:
            w = torch.cat([w, w.new_zeros(shape[0] - w.shape[0], *w.shape[1:])])
        return w


def is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / store.MANIFEST).is_file()


Shapes = Mapping[str, tuple[int, ...]]


def read_source(path: Path) -> tuple[ModelConfig, Mapping[str, torch.Tensor], Shapes]:
    """The source model's config, its full fp32 weights by plain-model name (each read when
    asked for) and their shapes (a tied model has no ``lm_head.weight``)."""
    if not path.exists():
        raise InitFromError(f"checkpoint.init_from={str(path)!r} does not exist (give a checkpoint "
                            "directory of this project, a checkpoint.dir, or a Hugging Face model directory)")
    if is_hf_directory(path):
        from megatron_lite.checkpoint.hf_source import open_hf

        cfg, weights, _ = open_hf(path)
        if cfg.tie_embeddings:
            weights.drop("lm_head.weight")
        return cfg, weights, weights.shapes
    from megatron_lite.checkpoint.convert import open_model

    _, cfg, weights = open_model(path)
    return cfg, weights, {name: weights.shape(name) for name in weights}


def field_differences(source: ModelConfig, run: ModelConfig) -> list[str]:
    """``model.FIELD=run's, the source's is ...`` for each field the source's weights fix: those
    of ``SAME_REQUIRED``, and ``max_seq_len`` with learned positions (a table of that length)."""
    fields = [*SAME_REQUIRED, *(("max_seq_len",) if run.position == "learned" else ())]
    sizes = {"n_kv_heads": lambda c: c.kv_heads, "ffn_hidden": lambda c: c.mlp_hidden}
    value = {f: sizes.get(f, lambda c, f=f: getattr(c, f)) for f in fields}
    return [f"model.{f}={value[f](run)!r}, the source's is {value[f](source)!r}"
            for f in fields if value[f](run) != value[f](source)]


def mismatches(source: ModelConfig, shapes: Shapes, run: ModelConfig) -> list[str]:
    """Every reason the run's model (resolved: padded vocabulary, tokenizer rows) cannot start
    from weights of ``shapes`` (by name): each field the weights fix that differs
    (``field_differences``), then each missing, extra or differently shaped parameter, one line
    each."""
    problems = field_differences(source, run)
    expected = {name: tuple(p.shape) for name, p in build_model(run, device="meta").named_parameters()}
    used = run.tokenizer_vocab_size or run.vocab_size
    for name in sorted(expected.keys() | shapes.keys()):
        if name not in shapes:
            problems.append(f"{name} {expected[name]}: not in the source")
        elif name not in expected:
            problems.append(f"{name} {shapes[name]}: in the source, not in this model")
        elif name in VOCAB_PARAMETERS:
            rows, want = shapes[name], expected[name]
            if rows[1:] != want[1:] or not used <= rows[0] <= want[0]:
                problems.append(f"{name} {rows} in the source, this model's is {want} with {used} "
                                "tokenizer rows (the source's rows must cover the tokenizer's and fit "
                                "the padded vocabulary)")
        elif shapes[name] != expected[name]:
            problems.append(f"{name} {shapes[name]} in the source, {expected[name]} here")
    return problems


def load_initial_weights(path: str, run: ModelConfig, log: Callable[[str], None]) -> InitialWeights:
    """The weights of ``checkpoint.init_from`` for the resolved model ``run``, checked: every
    mismatch is refused at once, in one error listing all of them."""
    from safetensors import SafetensorError

    source_path = Path(path)
    try:
        source, weights, shapes = read_source(source_path)
    except InitFromError:
        raise
    except (OSError, ValueError, KeyError, store.CheckpointError) as e:  # no weights, a corrupt file
        raise InitFromError(f"checkpoint.init_from={path!r}: {e}") from None
    except (SafetensorError, RuntimeError, pickle.UnpicklingError) as e:  # a file that is no weights
        raise InitFromError(f"checkpoint.init_from={path!r}: cannot read its weights ({type(e).__name__}: "
                            f"{first_line(e)}); download the model again") from None
    problems = mismatches(source, shapes, run)
    if problems:
        listed = "\n  ".join(problems)
        raise InitFromError(f"checkpoint.init_from={path!r} does not fit this run's model "
                            f"({len(problems)} problem(s)); set the recipe's model fields to the "
                            f"source's:\n  {listed}")
    differing = [f"init_from: model.{f}={getattr(run, f)!r} here, {getattr(source, f)!r} in the source "
             "(this run's value is used)" for f in MAY_CHANGE if getattr(run, f) != getattr(source, f)]
    kind = "Hugging Face model" if is_hf_directory(source_path) else "checkpoint"
    log(f"init_from: weights of the {kind} {path} ({len(weights)} tensors); step 0, a fresh "
        "optimizer and schedule, data from the start")
    for note in differing:
        log(note)
    return InitialWeights(weights, path)


def own_checkpoint(checkpoint_dir: str | None, resume: bool) -> Path | None:
    """The checkpoint a run resumes from instead of ``init_from`` (``latest`` in its
    ``checkpoint.dir``), None when it starts fresh."""
    if not (checkpoint_dir and resume):
        return None
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    latest = store.read_latest(root)
    return latest if latest is not None else (store.committed_steps(root) or [None])[0]
