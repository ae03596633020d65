"""The lowering's own registry of the exporter's op library against the exporter's full one:
the same functions for every operator, the same operators named as translated."""

from __future__ import annotations

from typing import Any

import pytest

from tests.plain_helpers import PLAIN_READY, SKIP_REASON

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)


def _full_registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    from ort_autopatch.engine.backends.ort import lowering

    return _registration.ONNXRegistry.from_torchlib(lowering.OPSET)


def test_the_graph_registry_gives_each_operator_the_full_registrys_functions() -> None:
    from ort_autopatch.engine.backends.ort import lowering, recurrent

    full = _full_registry()
    functions = full.functions
    ours = lowering.registry_for(metas[0].fx_target for metas in functions.values())
    # besides torchlib's: our own operators' translations, once a graph had them
    own = {op.name() for op in recurrent.TRANSLATIONS}
    assert set(ours.functions) - own == set(functions)
    for key, metas in functions.items():
        got = ours.functions[key]
        assert [(m.onnx_function, m.is_complex) for m in got] == [
            (m.onnx_function, m.is_complex) for m in metas
        ], key
        assert all(m.signature is not None or m.skip_signature_inference for m in got), key


def test_the_operators_named_as_translated_are_the_full_registrys() -> None:
    from torch.onnx._internal.exporter import _decomp

    from ort_autopatch.engine.backends.ort import lowering

    full = set(_decomp.get_onnx_implemented_overloads(_full_registry()))
    assert lowering.implemented() == full


def test_the_exporters_passes_run_under_the_export_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The type-promotion pass sets torch.fx's process-wide `preserve_node_meta` flag and puts
    back what it found: outside the lock every trace holds, a lowering in one thread ended
    another thread's aot trace under way ("expected preserved node meta")."""
    import threading

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.onnx._internal.exporter import _fx_passes

    from ort_autopatch.engine.backends.ort import lowering
    from ort_autopatch.engine.calls import EXPORT_LOCK

    free_to_others: list[bool] = []
    promote = _fx_passes.insert_type_promotion_nodes

    def probed(gm: torch.fx.GraphModule) -> None:
        def probe() -> None:  # another thread's trace: may it start now?
            taken = EXPORT_LOCK.acquire(blocking=False)
            if taken:
                EXPORT_LOCK.release()
            free_to_others.append(taken)

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        promote(gm)

    monkeypatch.setattr(_fx_passes, "insert_type_promotion_nodes", probed)
    gm = make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.randn(3))
    assert lowering.to_onnx(gm, "Net", "forward")
    assert free_to_others == [False]
