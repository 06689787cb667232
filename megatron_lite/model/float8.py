"""Float8 training of the transformer blocks' linear layers (``model.fp8``), a conversion applied
to the built model like the parallelize step, never inside the model code.

torchao's float8 training does the work (the same conversion torchtitan's ``float8`` converter
applies): each block ``nn.Linear`` becomes a ``Float8Linear`` that keeps its weight and bias
parameters (the same objects: optimizer state, ZeRO partitioning and checkpoints see no
difference) and casts the input, the weight and the output gradient to float8 with one dynamic
scale per tensor for its three products. The embeddings, norms, attention and the output layer
stay in the training precision: the output layer's logits are where float8's range would cost
the loss most.
"""

from __future__ import annotations

import logging

from torch import nn

from megatron_lite.model.transformer import Block


def _float8_api():
    """torchao's conversion, or an error that names the fix."""
    # torchao's import logs a warning for each optional CUDA extension it cannot load (kernels of
    # other features) and torch one about its registrations; float8 training needs none of them.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise RuntimeError(f"'model.fp8' = true needs torchao's float8 training ({e}): pip install "
                           "torchao (a release built for this torch), or set model.fp8=false") from e
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return Float8Linear, Float8LinearConfig, convert_to_float8_training


def float8_library_problem() -> str | None:
    """Why ``model.fp8`` cannot run with this machine's libraries (torchao missing or built for
    another torch), or None: checked before any data or model work."""
    try:
        _float8_api()
    except RuntimeError as e:
        return str(e)
    return None


def convert_blocks_to_float8(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` inside the transformer blocks of ``model`` (a whole model or a
    pipeline stage) for torchao's ``Float8Linear``; returns how many were swapped."""
    float8_linear, config, convert = _float8_api()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        convert(block, config=config(), module_filter_fn=lambda mod, _fqn: type(mod) is nn.Linear)
    return sum(isinstance(m, float8_linear) for block in blocks for m in block.modules())
