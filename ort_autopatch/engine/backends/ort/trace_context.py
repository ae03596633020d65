"""The process-wide rewrites active while the plain backend's capture traces a call.

One job: make a call traceable by aot_autograd on fake tensors, computing the values eager
computes. Each rewrite here replaces something torch or a library does at run time that a trace
cannot follow (a branch on tensor data, a write of forward's, a fused kernel with no ONNX form)
by a computation of the same values, and puts back what it found when the trace ends. They sit
apart from the capture (`capture`) because each changes state the whole process sees (listed in
docs/architecture.md, "Process-wide effects"): the capture enters them under
`calls.EXPORT_LOCK`. `real_constants_allowed` is also entered by the lowering (`lowering`),
whose type promotion runs a graph on fake tensors.

Attention is left to torch: the trace takes the kernel eager's call takes (chosen from the same
sizes, dtypes, mask and dropout), on CPU mostly the flash kernel, whose backward
`decompositions` computes as ATen's does (not the softmax's on fully masked rows); the math
kernel only where eager's choice is the math kernel too.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ort_autopatch.engine import tracing

_capturing = threading.local()


@contextlib.contextmanager
def libraries_tracing() -> Iterator[None]:
    """`torch.compiler.is_compiling()` is True in the capturing thread, as torch.export's
    non-strict trace sets it: libraries then skip their data-dependent shortcuts (transformers
    returns no mask when `torch.all(mask == 1)`, a bool of tensor data, which a trace on fake
    tensors cannot read) for the general computation of the same values. Other threads keep
    the real answer (torch.export sets a process-wide flag: their patched calls would take
    the compiled path meanwhile); the patcher holds the original function."""
    original = torch.compiler.is_compiling

    def is_compiling() -> bool:
        return bool(getattr(_capturing, "active", False)) or original()

    _capturing.active = True
    try:
        with tracing._swapped(torch.compiler, "is_compiling", is_compiling):
            yield
    finally:
        _capturing.active = False


def _no_causal_hint(mask: Any, is_causal: bool | None = None, size: Any = None) -> bool:
    return is_causal is True


def masks_as_given() -> contextlib.AbstractContextManager[None]:
    """`nn.TransformerEncoder`/`Decoder` given a mask and no `is_causal` compare the mask
    with a causal one (a bool of tensor data, which a trace on fake tensors cannot read) to
    pass attention a hint. The hint only picks between two computations of the same values
    (a causal attention, or the mask itself), so for the trace the mask is used as given."""
    from torch.nn.modules import transformer

    return tracing._swapped(transformer, "_detect_is_causal_mask", _no_causal_hint)


@contextlib.contextmanager
def generic_recurrent_kernels() -> Iterator[None]:
    """LSTMs as their gates' matmuls and activations, step by step: on CPU they otherwise
    trace to oneDNN's fused layer (`mkldnn_rnn_layer`), which has no ONNX form. torch's
    switch is process-wide: an eager call in another thread meanwhile takes the generic
    kernels too, with the same values. (`torch.backends.mkldnn.flags` would warn about TF32.)"""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def relisted_rnn_weights() -> Iterator[None]:
    """Recurrent modules (LSTM, GRU) run on a list of their weights, re-listed in forward
    when the parameters are other objects than those listed, as they are while aot traces (its
    stand-ins). That re-listing is a write of forward (`_flat_weight_refs`, refused as a side
    effect a graph cannot replay) which would leave the module pointing at the stand-ins. For
    the trace, the list alone is replaced, unseen by the side-effect recorder, and put back."""
    relisted: list[tuple[torch.nn.RNNBase, Any]] = []

    def relist(self: torch.nn.RNNBase) -> None:
        if self._weights_have_changed():
            relisted.append((self, vars(self)["_flat_weights"]))
            vars(self)["_flat_weights"] = [
                getattr(self, name, None) for name in self._flat_weights_names
            ]

    try:
        with tracing._swapped(torch.nn.RNNBase, "_update_flat_weights", relist):
            yield
    finally:
        for module, weights in reversed(relisted):
            vars(module)["_flat_weights"] = weights


@contextlib.contextmanager
def traceable_batch_norms(module: torch.nn.Module) -> Iterator[None]:
    """BatchNorms with `momentum=None` (a cumulative average) compute their update factor with
    `float(num_batches_tracked)`, which a trace on fake tensors cannot read. For the trace,
    such a module in training runs eager's arithmetic with the factor as a tensor: the same
    normalisation, and the same running statistics (updated in place, so they become the
    graph's buffer updates)."""
    swapped = []
    for sub in module.modules():
        if (
            isinstance(sub, torch.nn.modules.batchnorm._BatchNorm)
            and sub.momentum is None
            and sub.training
            and sub.track_running_stats
            and "forward" not in sub.__dict__
        ):
            sub.__dict__["forward"] = functools.partial(_cumulative_batch_norm, sub)
            swapped.append(sub)
    try:
        yield
    finally:
        for sub in swapped:
            del sub.__dict__["forward"]


def _cumulative_batch_norm(
    bn: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor
) -> torch.Tensor:
    assert bn.num_batches_tracked is not None
    assert bn.running_mean is not None and bn.running_var is not None
    bn._check_input_dim(x)
    bn.num_batches_tracked.add_(1)
    factor = 1.0 / bn.num_batches_tracked
    out = torch.nn.functional.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
    with torch.no_grad():
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x, dims, correction=1)
        bn.running_mean.lerp_(mean, factor)
        bn.running_var.lerp_(var, factor)
    return out


@contextlib.contextmanager
def real_constants_allowed() -> Iterator[None]:
    """Tensors forward reads that are neither the call's inputs nor the module's parameters
    and buffers (a plain tensor attribute: a cached mask, a carried-over hidden state) are
    constants of the graph, as the training build's trace bakes them: fake tensor modes in
    this thread (the trace's, and the exporter's type promotion pass) take them as they are.
    The call key guards each attribute by identity and version, so a new tensor or an
    in-place change selects another graph."""
    from torch._subclasses.fake_tensor import fake_tensor_tls

    previous = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = previous


@contextlib.contextmanager
def composites_replaced(decompositions: Mapping[Any, Callable[..., Any]]) -> Iterator[None]:
    """The table's entries marked `before_autograd` (composite operators, whose ATen kernel
    runs above autograd, where no decomposition table is read) as the operators' Python
    composite kernels, as torch registers its own (`py_impl(CompositeImplicitAutograd)`):
    aot_autograd traces under the Python dispatcher, which takes them in place of ATen's,
    and autograd differentiates what they call. Process-wide while it lasts, but read only
    where the Python dispatcher is on (a trace; torch.compile in another thread meanwhile
    would trace the same values); callers hold `calls.EXPORT_LOCK`. Put back as found."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    replaced = [
        (op, kernel)
        for op, kernel in decompositions.items()
        if getattr(kernel, "before_autograd", False)
    ]
    before = [(op, op.py_kernels.get(key)) for op, _ in replaced]
    try:
        for op, kernel in replaced:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
        yield
    finally:
        for op, kernel in before:
            if kernel is None:
                op.py_kernels.pop(key, None)
            else:
                op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
