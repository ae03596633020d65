"""Training loops of the libraries people combine with the tool, and torch features their models
use, train the selected class in ORT with eager's numbers.

Each test runs the same seeded training twice, first with nothing patched (eager), then with
the class patched, records what every call returned, and compares them call by call, then the
trained parameters; and asserts that every patched call ran in ORT."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import assert_close, class_stats, patched

RTOL, ATOL = 1e-4, 1e-5

Outcome = tuple[list[torch.Tensor], dict[str, torch.Tensor]]


@contextlib.contextmanager
def _patched(cls: type) -> Iterator[None]:
    yield from patched([cls])


def _compare(cls: type, train: Callable[[], Outcome], calls: int) -> None:
    """`train()` eagerly, then with `cls` patched: the same outputs call by call, the same
    trained state, and `calls` calls of `cls`, every one in ORT."""
    eager_outputs, eager_state = train()
    with _patched(cls):
        outputs, state = train()
        stats = class_stats(cls)
        assert (stats.ort_calls, dict(stats.eager_calls)) == (calls, {})
    assert len(outputs) == len(eager_outputs) == calls
    for k, (got, want) in enumerate(zip(outputs, eager_outputs, strict=True)):
        assert_close(got, want, f"call {k}", RTOL, ATOL)
    assert state.keys() == eager_state.keys()
    for name, want in eager_state.items():
        assert_close(state[name], want, f"trained {name}", RTOL, ATOL)


def _data(n: int = 32, features: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- Lightning --------------------------------------------------------------------------------
lightning = pytest.importorskip("lightning")


class LitRegressor(lightning.LightningModule):
    """A LightningModule whose training_step calls self(x): the call the tool takes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
        self.outputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.outputs.append(out.detach().clone())
        return F.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_lightning_module_trained_by_trainer_fit_runs_in_ort() -> None:
    def train() -> Outcome:
        torch.manual_seed(0)
        model = LitRegressor()
        trainer = lightning.Trainer(
            max_steps=4,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(_data(), batch_size=8))
        return model.outputs, _state(model)

    _compare(LitRegressor, train, calls=4)


# -- torch features inside a selected class ---------------------------------------------------
class Checkpointed(nn.Module):
    """Activation checkpointing of a block inside forward (non-reentrant, as torch advises)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(hidden + x)


class WeightNormed(nn.Module):
    """`nn.utils.parametrizations.weight_norm`: the weight is computed from g and v each call."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.utils.parametrizations.weight_norm(nn.Linear(8, 32))
        self.down = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _loop(cls: type[nn.Module], steps: int = 3) -> Outcome:
    """A plain training loop over a fresh seeded instance of `cls`."""
    torch.manual_seed(0)
    model = cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for x, y in list(DataLoader(_data(), batch_size=8))[:steps]:
        optimizer.zero_grad()
        out = model(x)
        F.mse_loss(out, y).backward()
        optimizer.step()
        outputs.append(out.detach().clone())
    return outputs, _state(model)


@pytest.mark.parametrize("cls", [Checkpointed, WeightNormed], ids=["checkpoint", "weight_norm"])
def test_torch_features_inside_forward_train_in_ort(cls: type[nn.Module]) -> None:
    _compare(cls, lambda: _loop(cls), calls=3)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_functional_call_with_other_parameters_runs_in_ort() -> None:
    # torch.func.functional_call swaps in other tensors for one call (meta-learning, ensembles)
    def train() -> Outcome:
        torch.manual_seed(0)
        model = Regressor()
        fast = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
        outputs = []
        for x, y in list(DataLoader(_data(), batch_size=8))[:3]:
            out = torch.func.functional_call(model, fast, (x,))
            loss = F.mse_loss(out, y)
            grads = torch.autograd.grad(loss, list(fast.values()))
            fast = {
                k: (v - 0.1 * g).detach().requires_grad_()
                for (k, v), g in zip(fast.items(), grads, strict=True)
            }
            outputs.append(out.detach().clone())
            outputs.append(model(x).detach().clone())  # the module's own parameters again
        return outputs, {**_state(model), **{f"fast.{k}": v.detach() for k, v in fast.items()}}

    _compare(Regressor, train, calls=6)


def test_an_averaged_model_ema_trains_and_evaluates_in_ort() -> None:
    # AveragedModel deep-copies the module (a patched instance) and calls it in eval
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def train() -> Outcome:
        torch.manual_seed(0)
        model = Regressor()
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        outputs = []
        batches = list(DataLoader(_data(), batch_size=8))[:3]
        for x, y in batches:
            optimizer.zero_grad()
            out = model(x)
            F.mse_loss(out, y).backward()
            optimizer.step()
            ema.update_parameters(model)
            outputs.append(out.detach().clone())
        with torch.no_grad():
            outputs.append(ema(batches[0][0]))
        return outputs, {**_state(model), **{f"ema.{k}": v for k, v in _state(ema).items()}}

    _compare(Regressor, train, calls=4)


# -- transformers, PEFT -------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _tiny_bert() -> Any:
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
        attn_implementation="eager",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        # the first call would set it, a change of state a graph cannot repeat (that call runs
        # in PyTorch: tests/test_examples.py::test_hf_trainer_example)
        problem_type="single_label_classification",
    )
    return transformers.BertForSequenceClassification(config)


def _tokens(n: int = 24, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (n, length), generator=generator)
    return ids, ids[:, 0] % 2


def test_a_peft_lora_model_over_a_transformers_class_runs_in_ort() -> None:
    peft = pytest.importorskip("peft")
    from transformers.models.bert.modeling_bert import BertForSequenceClassification

    def train() -> Outcome:
        torch.manual_seed(0)
        model = peft.get_peft_model(
            _tiny_bert(),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]),
        )
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        ids, labels = _tokens()
        outputs = []
        for step in range(3):
            batch = slice(8 * step, 8 * step + 8)
            optimizer.zero_grad()
            out = model(input_ids=ids[batch], labels=labels[batch])
            out.loss.backward()
            optimizer.step()
            outputs.append(out.logits.detach().clone())
        return outputs, _state(model)

    _compare(BertForSequenceClassification, train, calls=3)


def test_a_transformers_trainer_run_trains_in_ort(tmp_path: Any) -> None:
    from transformers.models.bert.modeling_bert import BertForSequenceClassification

    ids, labels = _tokens(n=16)
    rows = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)]

    class Recorder(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(torch.tensor(logs["loss"]))

    def train() -> Outcome:
        torch.manual_seed(0)
        model = _tiny_bert()
        recorder = Recorder()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=4,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=rows, callbacks=[recorder]
        )
        trainer.train()
        return recorder.losses, _state(model)

    _compare(BertForSequenceClassification, train, calls=4)
