"""Start-up speed of the processes the tests start (tests only; no effect on what they compute).

torch wraps some of its own functions (``Optimizer.add_param_group``, the functional Adam, ...)
in ``torch._compile._disable_dynamo``, whose first call imports ``torch._dynamo`` so that
TorchDynamo does not trace them: a second of CPU in every process that builds an optimizer,
and the suite starts a thousand such processes on two cores. Until ``torch._dynamo`` has been
imported nothing can be tracing, so the wrapper here calls the function directly until then, and
goes through torch's own wrapper (which imports TorchDynamo and disables it) from the first call
after anything else imported it (``torch.compile``, ...). A real run imports TorchDynamo at its
first ``add_param_group``; a rank under test imports it only if it compiles or recomputes
activations (torch's checkpoint code reads TorchDynamo's settings).

Likewise in DeepSpeed's ZeRO, which imports TorchDynamo and Inductor (two seconds of CPU) in
every rank and never traces: ``torch.compiler.disable`` (ZeRO-3's hooks) calls through until
TorchDynamo is imported, and ``torch.compile`` of a plain function (the Muon optimizer's module,
imported by ZeRO's optimizer check, compiles one at import) is made at the function's first
call rather than where it is decorated. Modules compile as before.
"""

from __future__ import annotations

import functools
import inspect
import sys

from tests.faults import after_import


def _until_dynamo(fn, disabled):
    """``fn`` called directly while ``torch._dynamo`` is not imported; from then on
    ``disabled()`` (torch's own wrapper of it, made at that first call)."""
    made = None

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        nonlocal made
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if made is None:
            made = disabled()
        return made(*args, **kwargs)

    return inner


def _lazy(original):
    def _disable_dynamo(fn=None, recursive=True):
        if fn is None:  # @_disable_dynamo(recursive=False)
            return functools.partial(_disable_dynamo, recursive=recursive)
        return _until_dynamo(fn, lambda: original(fn, recursive))

    return _disable_dynamo


def _lazy_grad_mode(original):
    def _use_grad_for_differentiable(func):
        wrapped = original(func)

        def _use_grad(*args, **kwargs):
            if "torch._dynamo" in sys.modules:
                return wrapped(*args, **kwargs)
            import torch

            before = torch.is_grad_enabled()
            try:  # torch's wrapper without its graph breaks, which only a trace needs
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(before)

        functools.update_wrapper(_use_grad, func)
        return _use_grad

    return _use_grad_for_differentiable


def _lazy_compiler_disable(original):
    def disable(fn=None, *args, **kwargs):
        if fn is None:  # @torch.compiler.disable(recursive=False)
            return functools.partial(disable, *args, **kwargs)
        return _until_dynamo(fn, lambda: original(fn, *args, **kwargs))

    return disable


def _lazy_compile(original):
    def compile(model=None, **options):  # noqa: A001 (torch's name)
        if model is None:  # @torch.compile(...)
            return functools.partial(compile, **options)
        if not inspect.isfunction(model):  # modules (and anything else) as torch does it
            return original(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = original(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile


def _patch(name: str, make):
    def patch(module) -> None:
        original = getattr(module, name, None)
        if callable(original):  # another torch may lay this out otherwise: then nothing changes
            setattr(module, name, make(original))

    return patch


def install() -> None:
    """Before torch is imported (``torch/__init__`` binds ``torch._disable_dynamo`` from
    ``torch._compile`` and decorates with it from then on)."""
    if "torch" not in sys.modules:
        after_import("torch._compile", _patch("_disable_dynamo", _lazy))
        after_import("torch.optim.optimizer", _patch("_use_grad_for_differentiable", _lazy_grad_mode))
        after_import("torch", _patch("compile", _lazy_compile))
        after_import("torch.compiler", _patch("disable", _lazy_compiler_disable))
