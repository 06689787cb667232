"""What differs between the DeepSpeed releases this project supports (setup.py's range), in one
place. Every entry names the release that changed the behaviour and where it matters; the
suite's DeepSpeed-facing tests run against the lowest supported release (docs/hardware.md)."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

# From 0.18.3 the engine divides the loss by the gradient-accumulation steps in every backward;
# before, only while its backward all-reduce is enabled (engine.backward), so switching that
# all-reduce off for a one-rank group would leave the gradients summed, not averaged - and the
# pipeline engine always switches it off (it reduces gradients itself).
GAS_SCALING_ALWAYS = Version("0.18.3")

# From 0.18.3 DeepSpeed-Ulysses's all-to-all takes the even path when gathering the heads back;
# before, a per-rank head count not divisible by the sequence-parallel size (e.g. the key/value
# gradients under grouped-query attention) took the uneven path, which asserts more heads than
# ranks.
ULYSSES_ANY_LOCAL_HEADS = Version("0.18.3")


# From 0.19.8 DeepSpeed's bf16 optimizer (bf16 without ZeRO) hands a non-finite gradient norm to
# the update gate; before, it asserts the norm is positive, so such a step stops the run instead of
# being skipped (ZeRO 1-3 skip it on every release).
BF16_NONFINITE_SKIPPED = Version("0.19.8")

# From 0.18.3 until 0.19.6 the pipeline engine's gradients do not match one process's: the
# gradient norm reads up to twice the true one (so clipping and the logged norm are wrong; the
# losses stay close because Adam hardly sees a scale), measured on 0.18.3, 0.18.5, 0.18.9,
# 0.19.0, 0.19.4 and 0.19.5 against 0.17.6, 0.18.2, 0.19.6, 0.19.7 and 0.19.8 (tests/distributed/
# layout_worker.py, pp2 against one process). Without ZeRO, 0.18.3 and 0.18.4 also stop at the
# first backward ("Direct calls to tensor.backward() are not supported").
PIPELINE_GRADIENTS_WRONG = (Version("0.18.3"), Version("0.19.6"))


def deepspeed_version() -> Version:
    """The installed release (a vendor fork's local label, e.g. ``0.16.1+hpu``, is kept)."""
    return Version(importlib.metadata.version("deepspeed"))


def ulysses_head_problems(n_heads: int, n_kv_heads: int, ulysses: int, tensor: int = 1) -> list[str]:
    """Why this DeepSpeed cannot run Ulysses over these heads (empty when it can)."""
    if ulysses <= 1 or deepspeed_version() >= ULYSSES_ANY_LOCAL_HEADS:
        return []
    problems = []
    for what, heads in (("model.n_heads", n_heads), ("model.n_kv_heads", n_kv_heads)):
        local = heads // tensor // ulysses
        if local % ulysses:
            problems.append(f"{what}={heads} leaves {local} head(s) per rank under parallel.tensor="
                            f"{tensor} × parallel.ulysses={ulysses}; DeepSpeed {deepspeed_version()} "
                            f"needs a multiple of {ulysses} there (DeepSpeed >= {ULYSSES_ANY_LOCAL_HEADS} "
                            "does not)")
    return problems


def pipeline_problem(pipeline: int) -> str | None:
    """Why this release cannot train a pipeline correctly, or None."""
    low, fixed = PIPELINE_GRADIENTS_WRONG
    if pipeline > 1 and low <= deepspeed_version() < fixed:
        return (f"parallel.pipeline={pipeline} does not train correctly on DeepSpeed {deepspeed_version()}: "
                f"from {low} until {fixed} its pipeline engine's gradients differ from one process's "
                f"(the gradient norm, and so clipping, is off by up to 2x): pip install "
                f"'deepspeed>={fixed}' (or '<{low}'), or train without parallel.pipeline")
    return None


def limitations(precision: str, zero_stage: int) -> list[str]:
    """What this DeepSpeed release does differently for the run (logged at start)."""
    if precision == "bf16" and zero_stage == 0 and deepspeed_version() < BF16_NONFINITE_SKIPPED:
        return [f"DeepSpeed {deepspeed_version()}'s bf16 optimizer stops the run on a non-finite "
                f"gradient instead of skipping the step (DeepSpeed >= {BF16_NONFINITE_SKIPPED} skips "
                "it); set parallel.zero_stage=1 to have such steps skipped"]
    return []
