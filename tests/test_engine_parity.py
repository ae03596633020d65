"""Exact parity of ModuleEngine with eager PyTorch over 10 optimizer steps, one test per model.

Dropout-free configurations are compared exactly (1e-4 relative); dropout itself, whose masks come
from ONNX Runtime's generator, is checked by its statistics, reproducibility and backward mask.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ort_autopatch.engine import EngineError, ModuleEngine, backend, runtime
from ort_autopatch.engine.errors import OutputAliasError
from tests.helpers import assert_training_parity

# A parity suite needs a backend that runs here: without one it fails at collection (with the
# reason and the remedy), it never vanishes as skips. (A backend registered by a test plugin,
# tests/toy_backend.py, needs no ONNX Runtime.)
if backend.resolve() in ("ort", "ort-training"):
    runtime.load(training=backend.resolve() == "ort-training")

STEPS = 10
#: The training build's graphs serve every input shape (and earn a static-shape graph for a
#: shape that keeps coming back); the plain backend traces a key's first graph for its input
#: shape, and the sizes that then vary as symbols (or one graph per shape where a model needs).
PER_SHAPE = backend.resolve() == "ort"


def _gen(step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * salt + step)


# ---------------------------------------------------------------------------------------------
# MLP
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


def test_mlp_adamw_parity() -> None:
    torch.manual_seed(0)
    target = torch.randn(8, 4)

    def inputs(step: int):
        return (torch.randn(8, 16, generator=_gen(step)),), {}

    run = assert_training_parity(
        MLP(),
        inputs,
        loss_fn=lambda y: F.mse_loss(y, target),
        optimizer="adamw",
        lr=1e-3,
        steps=STEPS,
    )
    assert run.engine_losses[-1] < run.engine_losses[0]


# ---------------------------------------------------------------------------------------------
# CNN with Conv2d, BatchNorm2d, MaxPool2d, Dropout
class CNN(nn.Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8, momentum=None)  # cumulative average: uses num_batches_tracked
        self.fc = nn.Linear(8 * 4 * 4, 10)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.drop(self.fc(x.flatten(1)))


def test_cnn_batchnorm_maxpool_parity_with_dropout_in_eval() -> None:
    torch.manual_seed(0)
    model = CNN()
    model.drop.eval()  # exact parity: the dropout submodule is off, everything else trains
    labels = torch.randint(0, 10, (6,), generator=_gen(0, 7))

    def inputs(step: int):
        return (torch.randn(6, 3, 16, 16, generator=_gen(step)),), {}

    run = assert_training_parity(
        model,
        inputs,
        loss_fn=lambda y: F.cross_entropy(y, labels),
        optimizer="sgd",
        lr=1e-2,
        steps=STEPS,
    )
    assert int(run.engine_model.bn1.num_batches_tracked) == STEPS


def test_cnn_dropout_rate_and_scaling_in_training() -> None:
    torch.manual_seed(0)
    p = 0.5
    model = CNN(p)
    engine = ModuleEngine(model)
    x = torch.randn(128, 3, 16, 16)
    y = engine(x)
    # The same model with its dropout off gives the pre-dropout values (BatchNorm in train mode
    # normalises with the batch statistics either way).
    reference = copy.deepcopy(model)
    reference.drop.eval()
    with torch.no_grad():
        pre = reference(x)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - p) < 0.06, f"dropped fraction {zeros:.3f}, expected about {p}"
    kept = y != 0
    torch.testing.assert_close(y[kept].detach(), pre[kept] / (1 - p), rtol=1e-4, atol=1e-5)
    y.sum().backward()
    assert all(p_.grad is not None for p_ in model.parameters())


# ---------------------------------------------------------------------------------------------
# TransformerEncoderLayer with a bool src_key_padding_mask keyword
def _encoder_layer(dropout: float) -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(
        d_model=32,
        nhead=4,
        dim_feedforward=64,
        dropout=dropout,
        norm_first=True,
        activation="gelu",
        batch_first=True,
    )


def _padding_mask(batch: int, length: int, step: int) -> torch.Tensor:
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=_gen(step, 3))
    lengths[0] = length  # one row without padding
    return torch.arange(length)[None, :] >= lengths[:, None]  # True = padding


def test_transformer_encoder_layer_parity_dropout_zero() -> None:
    layer = _encoder_layer(0.0)

    def inputs(step: int):
        length = _length(step)
        x = torch.randn(4, length, 32, generator=_gen(step))
        return (x,), {"src_key_padding_mask": _padding_mask(4, length, step)}

    def loss(y: torch.Tensor) -> torch.Tensor:
        return (y * y).mean()

    # SGD, not AdamW: the key bias has an exactly-zero true gradient (softmax is shift-invariant),
    # and Adam would turn its rounding noise into full-size steps of arbitrary sign.
    run = assert_training_parity(layer, inputs, loss_fn=loss, optimizer="sgd", lr=1e-2, steps=STEPS)
    _assert_every_kind_of_graph_ran(run)


def _length(step: int) -> int:
    """A first call of another length, then a length that keeps coming back: every kind of
    graph a key can have runs, each compared with eager (`_assert_every_kind_of_graph_ran`)."""
    return 9 if step == 0 else 12


def _assert_every_kind_of_graph_ran(run) -> None:
    records = run.engine.records
    # the first length's graph, the one for other lengths (plain: symbolic in the length), and
    # the one the repeated length earned (steps 8 and 9)
    if PER_SHAPE:
        assert [r.dynamic for r in records] == [False, True, False]
    else:
        assert [r.hot_shape for r in records] == [True, False, True]


def _mean_deviation(
    fn, x: torch.Tensor, mask: torch.Tensor, reference: torch.Tensor, seeds: range
) -> float:
    total = 0.0
    for seed in seeds:
        torch.manual_seed(seed)
        with torch.no_grad():
            total += (fn(x, src_key_padding_mask=mask) - reference).abs().mean().item()
    return total / len(seeds)


def test_transformer_encoder_layer_dropout_statistics_match_eager() -> None:
    layer = _encoder_layer(0.1)
    engine_layer = copy.deepcopy(layer)
    engine = ModuleEngine(engine_layer)
    x = torch.randn(8, 16, 32, generator=_gen(0))
    mask = _padding_mask(8, 16, 0)
    layer.eval()
    with torch.no_grad():
        clean = layer(x, src_key_padding_mask=mask)  # no dropout anywhere
    layer.train()
    eager = _mean_deviation(layer, x, mask, clean, range(6))
    ours = _mean_deviation(engine, x, mask, clean, range(6))
    assert eager > 0 and ours > 0
    assert 0.8 < ours / eager < 1.25, (
        f"mean |y - y_no_dropout|: engine {ours:.4g}, eager {eager:.4g}"
    )


def test_transformer_encoder_layer_attention_dropout_is_active() -> None:
    # Only the attention-probability dropout (inside the SDPA export) remains on.
    layer = _encoder_layer(0.1)
    layer.dropout.eval()
    layer.dropout1.eval()
    layer.dropout2.eval()
    engine_layer = copy.deepcopy(layer)
    engine = ModuleEngine(engine_layer)
    x = torch.randn(8, 16, 32, generator=_gen(1))
    mask = _padding_mask(8, 16, 1)
    layer.eval()
    with torch.no_grad():
        clean = layer(x, src_key_padding_mask=mask)
    layer.train()
    layer.dropout.eval()
    layer.dropout1.eval()
    layer.dropout2.eval()
    eager = _mean_deviation(layer, x, mask, clean, range(6))
    ours = _mean_deviation(engine, x, mask, clean, range(6))
    assert eager > 0, "eager attention dropout should perturb the output"
    assert ours > 0, "attention dropout never dropped in ONNX Runtime"
    assert 0.75 < ours / eager < 1.33, (
        f"mean |y - y_no_dropout|: engine {ours:.4g}, eager {eager:.4g}"
    )


def test_transformer_encoder_layer_dropout_reproducible_under_manual_seed() -> None:
    engine = ModuleEngine(_encoder_layer(0.1))
    x = torch.randn(4, 12, 32, generator=_gen(2))
    mask = _padding_mask(4, 12, 2)
    torch.manual_seed(123)
    first = engine(x, src_key_padding_mask=mask)
    torch.manual_seed(123)
    again = engine(x, src_key_padding_mask=mask)
    torch.manual_seed(124)
    other = engine(x, src_key_padding_mask=mask)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_transformer_encoder_layer_dropout_trains() -> None:
    torch.manual_seed(0)
    layer = _encoder_layer(0.1)
    engine = ModuleEngine(layer)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(4, 12, 32, generator=_gen(3))
    mask = _padding_mask(4, 12, 3)
    for _ in range(3):
        opt.zero_grad()
        y = engine(x, src_key_padding_mask=mask)
        (y * y).mean().backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
    assert engine.builds == 1


# ---------------------------------------------------------------------------------------------
# Dropout alone (p = 0.1): rate, scaling, backward reusing the forward mask
def test_dropout_rate_and_scaling() -> None:
    p = 0.1
    engine = ModuleEngine(nn.Dropout(p))
    x = torch.rand(200, 500) + 0.5  # never zero
    x.requires_grad_()
    y = engine(x)
    zeros = (y == 0).float().mean().item()
    assert abs(zeros - p) < 0.01, f"dropped fraction {zeros:.4f}, expected {p}"
    kept = y != 0
    torch.testing.assert_close(y[kept].detach(), x[kept].detach() / (1 - p), rtol=1e-6, atol=1e-6)


def test_dropout_backward_reuses_forward_mask() -> None:
    p = 0.1
    engine = ModuleEngine(nn.Dropout(p))
    x = (torch.rand(100, 300) + 0.5).requires_grad_()
    y = engine(x)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad == 0, y.detach() == 0), "gradient zeros differ from the forward mask"
    torch.testing.assert_close(
        x.grad[y.detach() != 0], torch.full_like(x.grad[y.detach() != 0], 1 / (1 - p))
    )


# ---------------------------------------------------------------------------------------------
# Embedding + cross-entropy inside forward
class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.emb(ids)))
        logits = self.head(h)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=0
        )


def test_embedding_cross_entropy_in_forward_parity() -> None:
    torch.manual_seed(0)

    def inputs(step: int):
        g = _gen(step)
        ids = torch.randint(1, 50, (4, 10), generator=g)
        ids[1, 6:] = 0  # padding
        ids[3, 8:] = 0
        targets = torch.roll(ids, -1, dims=1)
        return (ids, targets), {}

    run = assert_training_parity(
        TokenModel(), inputs, loss_fn=lambda loss: loss, optimizer="adamw", lr=1e-2, steps=STEPS
    )
    # padding_idx row never trained, as in eager
    assert not run.engine_model.emb.weight[0].any()


# ---------------------------------------------------------------------------------------------
# Two positional inputs, a keyword, a dict output holding a tuple, an int64 tensor and a passthrough
class MultiIO(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(5, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor, shift: float = 0.0):
        h = torch.relu(self.a(x) + self.b(y)) * scale + shift
        logits = self.out(h)
        return {"pair": (h, logits), "label": logits.argmax(-1), "y": y * 0.5}


class PassThrough(MultiIO):
    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor, shift: float = 0.0):
        return {**super().forward(x, y, scale=scale, shift=shift), "y": y}


def test_multi_input_keyword_dict_output_parity() -> None:
    torch.manual_seed(0)

    def inputs(step: int):
        g = _gen(step)
        x = torch.randn(7, 6, generator=g)
        y = torch.randn(7, 5, generator=g).requires_grad_()
        scale = torch.rand(8, generator=g) + 0.5
        return (x, y), {"scale": scale, "shift": 0.25}

    def loss(out) -> torch.Tensor:
        h, logits = out["pair"]
        assert out["label"].dtype == torch.int64
        return (h * h).mean() + logits.logsumexp(-1).mean() + out["y"].sum()

    assert_training_parity(MultiIO(), inputs, loss_fn=loss, optimizer="sgd", lr=1e-2, steps=STEPS)


def test_passthrough_output_is_the_input_itself_or_refused() -> None:
    """The plain backend returns the input itself, as eager; the training build, which could
    return only a copy (a later write into either would not reach the other), refuses."""
    torch.manual_seed(0)
    engine = ModuleEngine(PassThrough())
    x, y = torch.randn(3, 6), torch.randn(3, 5)
    if backend.resolve() == "ort-training":
        with pytest.raises(OutputAliasError, match="output 3 shares memory with input 1"):
            engine(x, y, scale=torch.ones(8))
        return
    out = engine(x, y, scale=torch.ones(8))
    assert torch.equal(out["y"], y)
    if backend.resolve() == "ort":
        assert out["y"] is y


# ---------------------------------------------------------------------------------------------
# GRU
class GRUModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16, num_layers=2, batch_first=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.fc(out[:, -1])


def test_gru_parity() -> None:
    # ONNX Runtime 1.19.2 takes the exported GRU with its gradient (measured); if a future
    # combination cannot, the engine must say so with a typed error rather than crash.
    torch.manual_seed(0)

    def inputs(step: int):
        return (torch.randn(4, 6 + step % 3, 8, generator=_gen(step)),), {}

    try:
        assert_training_parity(
            GRUModel(),
            inputs,
            loss_fn=lambda y: (y * y).mean(),
            optimizer="adamw",
            lr=1e-3,
            steps=STEPS,
            # three sequence lengths: the first length's graph, then one for every length
            # (the plain backend's GRU runs as a Scan over time, whatever its length)
            expect_builds=2,
        )
    except EngineError as exc:  # pragma: no cover - not the case with ORT 1.19.2
        pytest.fail(f"GRU rejected with {type(exc).__name__} ({exc.kind}): {exc}")


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


def test_lstm_parity() -> None:
    """The plain backend traces the LSTM step by step (oneDNN's fused CPU layer has no ONNX
    form)."""
    torch.manual_seed(0)

    def inputs(step: int):
        return (torch.randn(4, 6 + step % 2, 8, generator=_gen(step)),), {}

    run = assert_training_parity(
        LSTMModel(),
        inputs,
        loss_fn=lambda y: (y * y).mean(),
        optimizer="adamw",
        lr=1e-3,
        steps=4,
        expect_builds=2,  # two sequence lengths
    )
    assert run.engine.records and all(r.has_backward for r in run.engine.records)


class LSTMSequenceModel(nn.Module):
    """An LSTM over a batch of sequences, from given states or zeros, and a head on its
    outputs; the final states are outputs too, as a language model carries them on."""

    def __init__(self, **lstm: Any) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 10, **lstm)
        directions = 2 if lstm.get("bidirectional") else 1
        self.head = nn.Linear((lstm.get("proj_size") or 10) * directions, 3)

    def forward(
        self, x: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, (h, c) = self.lstm(x, states)
        return self.head(out), h, c


@pytest.mark.parametrize(
    ("states", "lstm"),
    [
        ("zeros", {"num_layers": 1}),
        ("given", {"num_layers": 2, "batch_first": True}),
        ("zeros", {"num_layers": 3, "bidirectional": True, "batch_first": True}),
        ("learned", {"num_layers": 2, "bidirectional": True}),
        ("given", {"num_layers": 2, "proj_size": 4, "batch_first": True}),
        ("learned", {"num_layers": 1, "proj_size": 4}),
    ],
    ids=[
        "one-layer",
        "two-layers-given-states",
        "three-bidirectional",
        "bidirectional-states-with-gradients",
        "projected",
        "projected-states-with-gradients",
    ],
)
def test_lstm_variants_train_and_evaluate_like_eager(states: str, lstm: dict[str, Any]) -> None:
    """Every LSTM layout torch offers, its states zeros, given (a language model's carried
    states) or learned (their gradients compared too), over batch sizes that change; then an
    evaluation call. The training build runs the LSTM as one torch-calling node (ORT's LSTM and
    LSTMGrad took 1.6x eager's step and refuse a bidirectional LSTM); the plain backend as one
    Scan per layer and direction, in ONNX."""
    torch.manual_seed(16)
    layers = lstm["num_layers"] * (2 if lstm.get("bidirectional") else 1)
    batches = (3, 5, 2, 4)

    def inputs(step: int) -> tuple[tuple[Any, ...], dict]:
        batch, gen = batches[step % 4], _gen(step)
        shape = (batch, 5, 6) if lstm.get("batch_first") else (5, batch, 6)
        x = torch.randn(*shape, generator=gen)
        if states == "zeros":
            return (x,), {}
        h0 = torch.randn(layers, batch, lstm.get("proj_size") or 10, generator=gen)
        c0 = torch.randn(layers, batch, 10, generator=gen)
        if states == "learned":
            h0.requires_grad_(True)
            c0.requires_grad_(True)
        return (x, (h0, c0)), {}

    run = assert_training_parity(
        LSTMSequenceModel(**lstm),
        inputs,
        loss_fn=lambda out: sum(t.square().mean() for t in out),
        steps=4,
    )
    nodes: dict[str, int] = {}
    for record in run.engine.records:
        nodes.update(record.torch_nodes)
    # the training build's LSTM is torch's kernel in its graph; other backends run it as
    # they run everything else (the plain backend: its Scan, in ONNX)
    assert nodes == ({"aten::lstm": 1} if backend.resolve() == "ort-training" else {})
    run.eager_model.eval()
    run.engine_model.eval()
    args, _ = inputs(5)
    with torch.no_grad():
        for got, want in zip(run.engine(*args), run.eager_model(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# transformers BertForSequenceClassification
@pytest.mark.parametrize(
    "attn_implementation",
    ["eager", "sdpa"],
)
def test_bert_for_sequence_classification_parity(attn_implementation: str) -> None:
    import transformers

    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    model.train()

    def inputs(step: int):
        g = _gen(step)
        ids = torch.randint(1, 100, (4, _length(step)), generator=g)
        ids[1, 7:] = 0  # pad token 0
        ids[3, 4:] = 0
        mask = (ids != 0).long()
        labels = torch.randint(0, 2, (4,), generator=g)
        return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def loss(out) -> torch.Tensor:
        assert isinstance(out, transformers.modeling_outputs.SequenceClassifierOutput)
        return out.loss

    # SGD: attention key biases have exactly-zero true gradients (see the encoder-layer test).
    run = assert_training_parity(model, inputs, loss_fn=loss, optimizer="sgd", lr=1e-2, steps=STEPS)
    assert run.engine_model.config._attn_implementation == attn_implementation
    _assert_every_kind_of_graph_ran(run)


# ---------------------------------------------------------------------------------------------
# The user's process after a build: a forked child of its own runs a backward
_USERS_FORK = """
import os, sys
import torch
from torch import nn
from ort_autopatch.engine import EngineOptions, ModuleEngine

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
options = EngineOptions(backend=sys.argv[2], threads=1, cache_dir=sys.argv[1])
engine = ModuleEngine(model, options)
out = engine(torch.randn(3, 4))
assert type(out.grad_fn).__name__ == "GraphFunctionBackward", "the call ran eagerly"
assert engine.builds == 1
pid = os.fork()
if pid == 0:  # a Hogwild trainer's worker: a backward of its own
    try:
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()
        os._exit(0 if x.grad.tolist() == [3.0, 3.0] else 2)
    except RuntimeError as exc:
        print(exc, file=sys.stderr, flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the user's child is forked")
@pytest.mark.skipif(
    backend.resolve() not in ("ort", "ort-training"), reason="a build of ONNX Runtime's"
)
def test_a_child_the_user_forks_after_a_first_call_runs_a_backward(tmp_path: Any) -> None:
    """A first call's build leaves autograd as the user's first backward would have: a child
    forked after it (a Hogwild trainer's worker) can still run a backward, on either backend.
    (The plain backend's trace, a backward on fake tensors, started autograd's device threads
    on torch 2.14's and 2.15's PyPI wheels, after which a forked child's backward raised.)"""
    done = subprocess.run(
        [sys.executable, "-c", _USERS_FORK, str(tmp_path), backend.resolve()],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-2000:]
