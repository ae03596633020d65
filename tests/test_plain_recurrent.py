"""LSTMs through the plain backend as one Scan per layer (`plain.recurrent`): eager's numbers
for every layout the layer takes, and a graph whose size does not grow with the length."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.plain_helpers import PLAIN_READY, SKIP_REASON, PlainCall, ran_in_plain_ort

pytestmark = pytest.mark.skipif(not PLAIN_READY, reason=SKIP_REASON)


class Recurrent(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.batch_first = bool(options.get("batch_first", False))
        self.lstm = nn.LSTM(4, 6, **options)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(x, tuple(state) if state else None)
        # every output of the layer reaches the loss: the steps, the final states
        return out.sum(-1).unsqueeze(-1) * 2 + h.sum() + 3 * c.sum()


def _train_like_eager(model: nn.Module, make_inputs, steps: int = 3) -> PlainCall:
    from tests.test_plain_backend import _train_like_eager as compare

    return compare(model, make_inputs, steps=steps)


@pytest.mark.parametrize(
    "options",
    [
        {"num_layers": 1},
        {"num_layers": 2, "batch_first": True},
        {"num_layers": 3},
        {"num_layers": 2, "bidirectional": True, "batch_first": True},
        {"num_layers": 1, "bias": False},
    ],
    ids=["1-layer", "2-layer-batch-first", "3-layer", "bidirectional", "no-bias"],
)
def test_an_lstm_trains_like_eager_with_one_scan_per_layer(options: dict[str, object]) -> None:
    model = Recurrent(**options)
    first = model.batch_first

    def inputs() -> tuple[torch.Tensor, ...]:
        shape = (3, 7, 4) if first else (7, 3, 4)
        return (torch.randn(*shape, requires_grad=True),)

    plain = _train_like_eager(model, inputs)
    layers = int(options["num_layers"]) * (2 if options.get("bidirectional") else 1)
    graphs = [plain.captured.forward.graph, plain.captured.backward.graph]
    scans = [
        sum(1 for n in g.nodes if "lstm_scan" in str(n.target) and n.op == "call_function")
        for g in graphs
    ]
    assert scans == [layers, layers], scans


def test_initial_states_that_need_gradients_get_eager_s() -> None:
    model = Recurrent(num_layers=2)

    def inputs() -> tuple[torch.Tensor, ...]:
        return (
            torch.randn(5, 3, 4, requires_grad=True),
            torch.randn(2, 3, 6, requires_grad=True),
            torch.randn(2, 3, 6, requires_grad=True),
        )

    _train_like_eager(model, inputs)


def test_float64_lstm_trains_like_eager() -> None:
    model = Recurrent(num_layers=2).double()
    _train_like_eager(model, lambda: (torch.randn(6, 2, 4, dtype=torch.float64),))


def test_the_graph_does_not_grow_with_the_sequence_length() -> None:
    """The recurrence is a Scan: 100 steps trace to the nodes of 5."""
    sizes = []
    for steps in (5, 100):
        model = Recurrent(num_layers=2)
        plain = PlainCall(model, torch.randn(steps, 2, 4))
        sizes.append(len(plain.captured.forward.graph.nodes))
        out = plain(torch.randn(steps, 2, 4))
        assert ran_in_plain_ort(out)
    assert sizes[0] == sizes[1], sizes


def test_dropout_between_layers_is_applied_as_in_eager() -> None:
    """torch's decomposition drops the layers' dropout (its condition is never true); eager
    applies it in training: two calls differ, and outputs equal eager's in eval mode."""
    from ort_autopatch.engine import ModuleEngine

    torch.manual_seed(0)
    model = Recurrent(num_layers=2, dropout=0.5)
    engine = ModuleEngine(model)
    x = torch.randn(5, 3, 4)
    first, second = engine(x), engine(x)
    assert ran_in_plain_ort(first)
    assert not torch.equal(first, second)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), model.forward(x), rtol=1e-5, atol=1e-5)


class GatedRecurrent(nn.Module):
    def __init__(self, **options: object) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 6, **options)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        out, h = self.gru(x, state[0] if state else None)
        return out.sum(-1).unsqueeze(-1) * 2 + 3 * h.sum()


@pytest.mark.parametrize(
    "options",
    [
        {"num_layers": 1},
        {"num_layers": 2},
        {"num_layers": 3, "bidirectional": True},
        {"num_layers": 1, "bias": False},
    ],
    ids=["1-layer", "2-layer", "3-layer-bidirectional", "no-bias"],
)
def test_a_gru_trains_like_eager_with_one_scan_per_layer(options: dict[str, object]) -> None:
    model = GatedRecurrent(**options)
    plain = _train_like_eager(model, lambda: (torch.randn(7, 3, 4, requires_grad=True),))
    layers = int(options["num_layers"]) * (2 if options.get("bidirectional") else 1)
    graphs = [plain.captured.forward.graph, plain.captured.backward.graph]
    scans = [
        sum(1 for n in g.nodes if "gru_scan" in str(n.target) and n.op == "call_function")
        for g in graphs
    ]
    assert scans == [layers, layers], scans


def test_a_gru_s_initial_state_gets_eager_s_gradient() -> None:
    model = GatedRecurrent(num_layers=2).double()
    _train_like_eager(
        model,
        lambda: (
            torch.randn(5, 3, 4, dtype=torch.float64),
            torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True),
        ),
    )


def test_the_operators_eager_kernels_have_their_own_gradients() -> None:
    """The torch kernels of our operators (run where no graph is: a trace's first run, these
    tests) against autograd's numerical gradients."""
    from ort_autopatch.engine.backends.ort import recurrent

    torch.manual_seed(0)
    steps, batch, hidden = 4, 2, 3

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    lstm_args = (tensor(steps, batch, 4 * hidden), tensor(batch, hidden), tensor(batch, hidden))
    assert torch.autograd.gradcheck(
        lambda *a: recurrent.lstm_scan(*a)[:2], (*lstm_args, tensor(4 * hidden, hidden))
    )
    gru_args = (tensor(steps, batch, 3 * hidden), tensor(batch, hidden))
    assert torch.autograd.gradcheck(
        lambda *a: recurrent.gru_scan(*a)[0],
        (*gru_args, tensor(3 * hidden, hidden), tensor(3 * hidden)),
    )
