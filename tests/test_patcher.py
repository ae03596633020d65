"""The patched class: zero code changes, guards, fallbacks, hooks and stepping aside."""

from __future__ import annotations

import copy
import logging
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

import ort_autopatch
from ort_autopatch import patcher, report
from ort_autopatch.engine import EngineError, EngineOptions, UnsupportedInputError
from ort_autopatch.policy import Fallback, SkipCheck
from tests.helpers import patched, plain_backend, repatch
from tests.proc_helpers import FOREGROUND_BUILDS


class UserDefinedMethodsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.0)
        self.scale = 2.0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)) * self.scale

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return nn.functional.cross_entropy(self(x), y)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class TakesAnything(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, extra: object = None) -> torch.Tensor:
        return self.fc(x)


class Settings:
    def __init__(self) -> None:
        self.double = False


class ReadsConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.config = Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2 if self.config.double else y


class EvalOnlyUnsupported(nn.Module):
    """Exports in train mode; in eval mode it uses an op the ONNX exporter cannot take
    (erfinv) and one no backend runs in torch inside its graph either: a random operator with
    no ONNX form (the plain backend's torch nodes refuse it), here with its outcome fixed
    (a Poisson draw at rate 0 is 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.training:
            return y
        return torch.special.erfinv(torch.tanh(y) * 0.5) + torch.poisson(torch.zeros_like(y))


class NoGradient(nn.Module):
    """Exports, but ORT has no gradient for Round."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(self.fc(x)) * self.fc(x)


class Float64Relu(nn.Module):
    """ORT's CPU provider has no float64 Erf kernel: an inference session cannot be created.
    (float64 training is refused earlier, before any gradient build.)"""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erf(self.fc(x))


PATCHED = (
    UserDefinedMethodsNet,
    Inner,
    Outer,
    TakesAnything,
    ReadsConfig,
    EvalOnlyUnsupported,
    NoGradient,
    Float64Relu,
)


#: EvalOnlyUnsupported and NoGradient stand for models ORT cannot take: keep their operators
#: from becoming torch-calling nodes (which would run them in ORT after all).
NO_TORCH = EngineOptions(no_torch_ops=("aten::*erfinv", "aten::round"))


@pytest.fixture(autouse=True)
def _patched() -> Iterator[None]:
    yield from patched(PATCHED, patcher.Settings(engine=NO_TORCH))


def _stats(cls: type) -> report.ClassStats:
    return report.stats_for(patcher.class_name(cls))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)


def _eager_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)
    return twin


def _eager(model: nn.Module, *args: object) -> torch.Tensor:
    return model.forward(*args)  # type: ignore[no-any-return]


def test_training_step_calling_self_trains_through_ort() -> None:
    torch.manual_seed(0)
    model = UserDefinedMethodsNet()
    twin = _eager_twin(model)
    x, y = _data()
    model.training_step(x, y).backward()
    nn.functional.cross_entropy(_eager(twin, x), y).backward()
    torch.testing.assert_close(model.fc.weight.grad, twin.fc.weight.grad)
    assert _stats(UserDefinedMethodsNet).ort_calls == 1
    assert model.step == 1


def test_state_dict_pickle_deepcopy_repr_and_isinstance_are_unchanged() -> None:
    model = UserDefinedMethodsNet()
    model(_data()[0])
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone) is UserDefinedMethodsNet and isinstance(model, UserDefinedMethodsNet)
    assert list(clone.state_dict()) == list(model.state_dict())
    assert repr(copy.deepcopy(model)) == repr(model)
    assert "_ort" not in "".join(vars(model))


def test_unpatch_restores_the_class_exactly() -> None:
    assert patcher.unpatch(UserDefinedMethodsNet)
    assert "__call__" not in UserDefinedMethodsNet.__dict__
    assert "__setattr__" not in UserDefinedMethodsNet.__dict__
    assert not patcher.is_patched(UserDefinedMethodsNet)


def test_writing_an_attribute_forward_reads_rebuilds_and_a_toggle_back_reuses() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    model.scale = 3.0
    torch.testing.assert_close(model(x), _eager(model, x))
    model.scale = 2.0
    torch.testing.assert_close(model(x), _eager(model, x))
    stats = _stats(UserDefinedMethodsNet)
    assert stats.exports == 2
    assert stats.rebuilds["attribute UserDefinedMethodsNet.scale written"] == 1


def test_writing_an_attribute_forward_never_reads_does_not_rebuild() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    for _ in range(3):
        model.step += 1
        model(x)
    stats = _stats(UserDefinedMethodsNet)
    assert stats.exports == 1
    assert stats.ignored_writes == 3


def test_a_write_deep_in_the_tree_is_seen() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    model.drop.p = 1.0  # drops everything: the old graph would not
    assert torch.count_nonzero(model(x)) == 0


def test_a_replaced_submodule_is_seen() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    model.fc = nn.Linear(4, 3)
    torch.testing.assert_close(model(x), _eager(model, x))


def test_mark_stale_forces_a_new_export() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    patcher.mark_stale(model)
    model(x)
    assert _stats(UserDefinedMethodsNet).exports == 2


def test_nested_selected_modules_export_once_from_the_outside() -> None:
    model = Outer()
    x, _ = _data()
    torch.testing.assert_close(model(x), model.head(torch.tanh(model.inner.fc(x))))
    assert _stats(Outer).ort_calls == 1
    assert _stats(Inner).ort_calls == 0


def test_an_inner_selected_module_called_alone_uses_its_own_graph() -> None:
    model = Outer()
    x, _ = _data()
    model.inner(x)
    assert _stats(Inner).ort_calls == 1


def test_the_patched_call_steps_aside_under_jit_trace() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert _stats(UserDefinedMethodsNet).ort_calls == 0
    assert "aten::linear" in str(traced.inlined_graph)
    torch.testing.assert_close(traced(x), _eager(model, x))


def test_the_patched_call_steps_aside_under_a_users_onnx_export(tmp_path: Path) -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    torch.onnx.export(model, (x,), str(tmp_path / "user.onnx"), dynamo=False)
    assert _stats(UserDefinedMethodsNet).ort_calls == 0
    ops = {n.op_type for n in onnx.load(str(tmp_path / "user.onnx")).graph.node}
    assert "Gemm" in ops


def test_unsupported_input_falls_back_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = TakesAnything()
    x, _ = _data()
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        for _ in range(3):
            torch.testing.assert_close(model(x, object()), _eager(model, x))
    warnings = [r for r in caplog.records if "runs in PyTorch" in r.getMessage()]
    assert len(warnings) == 1
    stats = _stats(TakesAnything)
    assert sum(stats.fallbacks.values()) == 3 and stats.ort_calls == 0


def test_the_fallback_warning_names_the_remedies(caplog: pytest.LogCaptureFixture) -> None:
    model = TakesAnything()
    x, _ = _data()
    with caplog.at_level(logging.WARNING, logger="ort_autopatch"):
        model(x, object())
    (message,) = [r.getMessage() for r in caplog.records if "runs in PyTorch" in r.getMessage()]
    name = patcher.class_name(TakesAnything)
    assert f"--exclude '{name}' (ORT_AUTOPATCH_EXCLUDE)" in message
    assert "--fallback FALLBACK_DISABLE (ORT_AUTOPATCH_FALLBACK_POLICY)" in message
    assert "--save-onnx DIR (ORT_AUTOPATCH_SAVE_ONNX)" in message


def test_patch_by_hand_follows_the_configuration_install_would_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ORT_AUTOPATCH_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORT_AUTOPATCH_CACHE_SIZE", "3")

    class ByHand(TakesAnything):
        pass

    assert ort_autopatch.patch(ByHand)
    model = ByHand()
    with pytest.raises(UnsupportedInputError):
        model(_data()[0], extra=object())
    assert patcher._instances[model].engine.options.cache_size == 3


def test_each_class_keeps_the_settings_it_was_patched_with() -> None:
    repatch(TakesAnything, patcher.Settings(fallback=Fallback.FALLBACK_DISABLE))

    class Child(TakesAnything):  # inherits the patch and its settings
        pass

    class Sibling(nn.Module):  # patched with the defaults: falls back
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, extra: object = None) -> torch.Tensor:
            return self.fc(x)

    patcher.patch(Sibling)
    x, _ = _data()
    for cls in (TakesAnything, Child):
        with pytest.raises(UnsupportedInputError):
            cls()(x, extra=object())
    sibling = Sibling()
    torch.testing.assert_close(sibling(x, extra=object()), _eager(sibling, x))
    assert _stats(Sibling).eager_calls["fallback: unsupported input"] == 1


def test_fallback_disable_raises_the_typed_error() -> None:
    repatch(TakesAnything, patcher.Settings(fallback=Fallback.FALLBACK_DISABLE))
    with pytest.raises(UnsupportedInputError, match="extra"):
        TakesAnything()(_data()[0], extra=object())


def test_a_fallback_belongs_to_one_call_signature() -> None:
    model = TakesAnything()
    x, _ = _data()
    model(x, object())
    model(x)
    assert _stats(TakesAnything).ort_calls == 1


def test_forward_hooks_on_the_patched_module_run_as_in_eager() -> None:
    model = UserDefinedMethodsNet()
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model.register_forward_hook(lambda m, args, out: seen.append(out) or out + 1)
    x, _ = _data()
    out = model(x)
    torch.testing.assert_close(out, _eager(model, x * 2) + 1)
    assert len(seen) == 1 and _stats(UserDefinedMethodsNet).ort_calls == 1


def test_a_data_parallel_replica_runs_eagerly_with_its_reason() -> None:
    """What nn.DataParallel builds on every forward with several GPUs: a fresh replica."""
    model = UserDefinedMethodsNet()
    replica = model._replicate_for_data_parallel()
    x = torch.randn(2, 4)
    assert torch.equal(replica(x), model.forward(x))
    stats = _stats(UserDefinedMethodsNet)
    assert stats.ort_calls == 0
    assert stats.eager_calls["DataParallel replica (use DistributedDataParallel)"] == 1


def test_hooks_on_submodules_run_eagerly_instead_of_being_skipped() -> None:
    model = UserDefinedMethodsNet()
    calls: list[int] = []
    model.fc.register_forward_hook(lambda m, a, o: calls.append(1))
    model(_data()[0])
    assert calls == [1]
    assert _stats(UserDefinedMethodsNet).eager_calls["hooks on submodules"] == 1


def test_skip_check_build_gradient_trades_stale_detection_for_speed() -> None:
    repatch(UserDefinedMethodsNet, patcher.Settings(skip_check=SkipCheck.SKIP_CHECK_BUILD_GRADIENT))
    model = UserDefinedMethodsNet()
    x, _ = _data()
    before = model(x)
    model.scale = 5.0
    torch.testing.assert_close(model(x), before)  # the documented trade: the graph is reused
    assert _stats(UserDefinedMethodsNet).exports == 1


def _run(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    root = Path(__file__).resolve().parent.parent
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), **FOREGROUND_BUILDS, **env}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=environ
    )


def test_disabled_installs_no_finder(tmp_path: Path) -> None:
    result = _run(
        """
        import sys
        before = list(sys.meta_path)
        import ort_autopatch.auto
        print(sys.meta_path == before)
        """,
        tmp_path,
        ORT_AUTOPATCH_ENABLED="0",
        ORT_AUTOPATCH_MODULES="__main__:Net",
    )
    assert result.stdout.strip() == "True", result.stderr


def test_a_class_defined_in_main_is_patched_when_created(tmp_path: Path) -> None:
    result = _run(
        """
        import ort_autopatch.auto
        import torch
        from torch import nn
        from ort_autopatch import report

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 2)
            def forward(self, x):
                return self.fc(x)

        net = Net()
        net(torch.randn(3, 4)).sum().backward()
        print(report.snapshot()["__main__:Net"]["ort_calls"])
        """,
        tmp_path,
        ORT_AUTOPATCH_MODULES="__main__:Net",
    )
    assert result.stdout.strip() == "1", result.stderr


def test_a_flag_on_a_config_object_forward_reads_is_guarded() -> None:
    model = ReadsConfig()
    x, _ = _data()
    model(x)
    model.config.double = True
    torch.testing.assert_close(model(x), 2 * model.fc(x))
    assert type(model.config) is Settings  # the recording subclass never outlives the export
    assert _stats(ReadsConfig).rebuilds["attribute Settings.double written"] == 1


def test_a_replaced_parameter_is_fed_and_seen() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    model.fc.weight = nn.Parameter(torch.ones(3, 4))
    torch.testing.assert_close(model(x), _eager(model, x))


def test_freezing_a_parameter_rebuilds_without_its_gradient() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x).sum().backward()
    model.zero_grad()
    model.fc.weight.requires_grad_(False)
    model(x).sum().backward()
    assert model.fc.weight.grad is None and model.fc.bias.grad is not None
    assert _stats(UserDefinedMethodsNet).exports == 2


def test_a_write_to_the_patched_instance_after_init_is_not_a_structural_change() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    model.note = "free-form attributes stay usable"
    assert model.note == "free-form attributes stay usable"
    model(x)
    assert _stats(UserDefinedMethodsNet).exports == 1


def test_an_eval_mode_failure_does_not_send_training_to_pytorch() -> None:
    model = EvalOnlyUnsupported()
    x, _ = _data()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), _eager(model, x))
    model.train()
    model(x).sum().backward()
    stats = _stats(EvalOnlyUnsupported)
    assert stats.ort_calls == 1
    assert stats.eager_calls["fallback: export failed"] == 1


def test_a_failed_graph_is_not_retried_on_every_call() -> None:
    model = EvalOnlyUnsupported().eval()
    x, _ = _data()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    assert sum(_stats(EvalOnlyUnsupported).fallbacks.values()) == 3
    assert patcher._instances[model].engine is not None
    assert len(patcher._instances[model].engine.records) == 0  # export never succeeded


@pytest.mark.parametrize(
    ("cls", "flag", "error"),
    [
        (TakesAnything, Fallback.FALLBACK_UNSUPPORTED_DATA, "unsupported input"),
        (EvalOnlyUnsupported, Fallback.FALLBACK_UNSUPPORTED_TORCH_MODEL, "export failed"),
        pytest.param(
            NoGradient,
            Fallback.FALLBACK_UNSUPPORTED_ONNX_MODEL,
            "gradient build failed",
            marks=pytest.mark.skipif(
                plain_backend(),
                reason="the plain backend has no ONNX gradient builder to fail: torch's "
                "autograd differentiates Round (to zero) and the call trains in ORT",
            ),
        ),
        (Float64Relu, Fallback.FALLBACK_BAD_INITIALIZATION, "session creation failed"),
    ],
)
def test_each_fallback_flag_covers_its_kind_of_failure(
    cls: type[nn.Module], flag: Fallback, error: str
) -> None:
    def call(model: nn.Module) -> torch.Tensor:
        if cls is TakesAnything:
            return model(_data()[0], object())  # type: ignore[no-any-return]
        if cls is EvalOnlyUnsupported:
            model.eval()
        if cls is Float64Relu:
            with torch.no_grad():
                return model(_data()[0].double())  # type: ignore[no-any-return]
        return model(_data()[0])  # type: ignore[no-any-return]

    repatch(cls, patcher.Settings(fallback=flag, engine=NO_TORCH))
    call(cls())
    assert _stats(cls).eager_calls[f"fallback: {error}"] == 1
    others = (
        Fallback.FALLBACK_BAD_INITIALIZATION
        if flag != Fallback.FALLBACK_BAD_INITIALIZATION
        else Fallback.FALLBACK_UNSUPPORTED_DATA
    )
    repatch(cls, patcher.Settings(fallback=others, engine=NO_TORCH))
    with pytest.raises(EngineError) as raised:
        call(cls())
    assert raised.value.reason == error and raised.value.remedy


def test_force_torch_forward_falls_back_on_unexpected_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ort_autopatch.engine import ModuleEngine

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something nobody planned for")

    monkeypatch.setattr(ModuleEngine, "run", broken)
    x, _ = _data()
    repatch(UserDefinedMethodsNet, patcher.Settings(fallback=Fallback.FALLBACK_UNSUPPORTED_DATA))
    with pytest.raises(RuntimeError, match="nobody planned"):
        UserDefinedMethodsNet()(x)
    repatch(UserDefinedMethodsNet, patcher.Settings(fallback=Fallback.FALLBACK_FORCE_TORCH_FORWARD))
    model = UserDefinedMethodsNet()  # an instance keeps the settings of its first call
    torch.testing.assert_close(model(x), _eager(model, x))
    assert _stats(UserDefinedMethodsNet).eager_calls["fallback: unexpected error"] == 1


def test_skip_check_device_skips_only_the_device_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from ort_autopatch.engine import ModuleEngine

    seen: list[object] = []
    run = ModuleEngine.run

    def spy(self: ModuleEngine, *args: object, **kwargs: object) -> object:
        seen.append((kwargs["check_devices"], kwargs["trust_last"]))
        return run(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ModuleEngine, "run", spy)
    repatch(UserDefinedMethodsNet, patcher.Settings(skip_check=SkipCheck.SKIP_CHECK_DEVICE))
    UserDefinedMethodsNet()(_data()[0])
    assert seen == [(False, False)]


def test_skip_check_execution_agent_alone_keeps_every_check() -> None:
    repatch(
        UserDefinedMethodsNet, patcher.Settings(skip_check=SkipCheck.SKIP_CHECK_EXECUTION_AGENT)
    )
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    model.scale = 4.0
    torch.testing.assert_close(model(x), _eager(model, x))


def test_the_default_skip_check_policy_checks_everything() -> None:
    assert patcher.Settings().skip_check == SkipCheck.SKIP_CHECK_DISABLED


def test_a_hook_registered_on_a_submodule_after_the_first_call_is_seen() -> None:
    model = UserDefinedMethodsNet()
    x, _ = _data()
    model(x)
    calls: list[int] = []
    handle = model.fc.register_forward_hook(lambda m, a, o: calls.append(1))
    model(x)
    handle.remove()
    model(x)
    assert calls == [1]
    stats = _stats(UserDefinedMethodsNet)
    assert stats.eager_calls["hooks on submodules"] == 1 and stats.ort_calls == 2
