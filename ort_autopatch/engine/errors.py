"""Typed engine failures.

Each error names the module class, the cause and what the user can do (`OrtAutopatchError`'s
`cause` and `remedy`: one root for every deliberate error of the tool), and carries a `kind`
that the fallback policy maps to ORTModule's FALLBACK_* names, so the engine itself never needs
to know about policies or configuration.
"""

from __future__ import annotations

import enum

from ort_autopatch.errors import OrtAutopatchError


class FailureKind(enum.Enum):
    """Why ONNX Runtime could not take a call; mirrors ORTModule's fallback categories."""

    UNSUPPORTED_DEVICE = "unsupported_device"
    UNSUPPORTED_DATA = "unsupported_data"
    UNSUPPORTED_TORCH_MODEL = "unsupported_torch_model"
    UNSUPPORTED_ONNX_MODEL = "unsupported_onnx_model"
    BAD_INITIALIZATION = "bad_initialization"
    RUNTIME = "runtime"


class EngineError(OrtAutopatchError, RuntimeError):
    """Base of every failure raised by the engine; `module_class` is "" for failures that
    concern no one class (ONNX Runtime missing, say)."""

    kind: FailureKind = FailureKind.RUNTIME
    reason: str = "engine error"
    #: a documented limitation (said at INFO), not a failure to report (a WARNING)
    known_limitation: bool = False

    def __init__(self, module_class: str, cause: str, remedy: str) -> None:
        self.module_class = module_class
        self.cause = cause
        self.remedy = remedy
        prefix = f"{module_class}: " if module_class else ""
        super().__init__(f"{prefix}{cause}. {remedy}")

    def __reduce__(self) -> tuple[type[EngineError], tuple[str, str, str]]:
        # Rebuilt from the fields (the default would pass the message as `module_class`).
        return (type(self), (self.module_class, self.cause, self.remedy))


class UnsupportedInputError(EngineError):
    """An argument the graph cannot take (a non-tensor leaf that is not a plain constant)."""

    kind = FailureKind.UNSUPPORTED_DATA
    reason = "unsupported input"


class AutocastUnsupportedError(EngineError):
    """ONNX Runtime's build for the device has no kernel for an operator in autocast's dtype
    (its CPU build has no bfloat16 Gemm): calls under that autocast run in PyTorch."""

    kind = FailureKind.UNSUPPORTED_DATA
    reason = "autocast dtype without ONNX Runtime kernels"
    known_limitation = True


class MixedDevicesError(EngineError):
    """Inputs, parameters or buffers live on more than one device."""

    kind = FailureKind.UNSUPPORTED_DEVICE
    reason = "mixed devices"


class UnsupportedDeviceError(EngineError):
    """The tensors live on a device ONNX Runtime has no provider for here."""

    kind = FailureKind.UNSUPPORTED_DEVICE
    reason = "unsupported device"


class UnsupportedModelError(EngineError):
    """Something about the module the engine knows it cannot reproduce faithfully."""

    kind = FailureKind.UNSUPPORTED_TORCH_MODEL
    reason = "unsupported model"


class ExportError(EngineError):
    """torch.onnx.export failed on the module."""

    kind = FailureKind.UNSUPPORTED_TORCH_MODEL
    reason = "export failed"


class GradientBuildError(EngineError):
    """ONNX Runtime's gradient builder could not differentiate the exported graph."""

    kind = FailureKind.UNSUPPORTED_ONNX_MODEL
    reason = "gradient build failed"


class SessionError(EngineError):
    """ONNX Runtime could not create a session for the graph."""

    kind = FailureKind.BAD_INITIALIZATION
    reason = "session creation failed"


class RuntimeUnavailableError(EngineError):
    """No ONNX Runtime training build can be imported in this interpreter."""

    kind = FailureKind.BAD_INITIALIZATION
    reason = "onnxruntime-training unavailable"


class ExecutionError(EngineError):
    """ONNX Runtime failed while running forward or backward."""

    kind = FailureKind.RUNTIME
    reason = "execution failed"


class DataDependentError(UnsupportedModelError):
    """forward decides something from tensor values, which a traced graph would freeze."""

    reason = "data-dependent control flow"


class BuildOverBudget(EngineError):
    """Building a graph would cost more than the calls it could speed up (engine/budget.py)."""

    kind = FailureKind.UNSUPPORTED_TORCH_MODEL
    reason = "build over budget"


class InputWriteError(UnsupportedModelError):
    """forward writes into one of its inputs, and the backend cannot write the new value
    back into the caller's tensor (the training build): a graph would leave the caller's
    tensor as it was, a wrong value."""

    reason = "forward writes into its inputs"
    known_limitation = True


class OutputAliasError(UnsupportedModelError):
    """An output shares memory with an input, a parameter or a buffer, and the backend can
    only return a copy (the training build): a later write into either would not reach the
    other, as it does in eager, nor would an optimizer step reach a returned parameter view."""

    reason = "an output shares memory with an input or parameter"
    known_limitation = True


class UnrepeatableDrawsError(UnsupportedModelError):
    """A graph with random operators ONNX Runtime seeds once per session (`RandomNormalLike`
    from `randn_like`, `Bernoulli`, ...) would be run again for the same call (activation
    checkpointing, a recomputing forward): the rerun would draw other numbers than the run it
    replays, where eager's replays the same, so the gradients would be of another draw."""

    reason = "random operators a rerun cannot repeat"
    known_limitation = True


#: Why `BuildingAside` ran a call in PyTorch, as the report counts it
BUILDING = "graph building in a helper process"
WAITING = "waiting for another graph's build"


class BuildingAside(Exception):
    """Not a failure: the call's graph is being built in a helper process (`aside.py`), so
    this call runs in PyTorch; the graph cache remembers nothing of it, and a later call of
    the same key finds the graph built. No `EngineError`: no fallback policy applies."""
