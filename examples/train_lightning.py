"""A LightningModule trained by `lightning.Trainer.fit`, unchanged.

    python -m ort_autopatch --log-level INFO --modules __main__:Classifier \\
        examples/train_lightning.py

Lightning's loop calls `training_step`, whose `self(x)` is the call the tool takes: the
selected LightningModule's forward runs in ONNX Runtime, and Lightning's optimizer step,
logging and callbacks are untouched. A few steps on synthetic data, on CPU.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x[:, :4].argmax(1)).long()  # a rule the model can learn
    trainer = lightning.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier()
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    loss = float(trainer.callback_metrics["loss"])
    print(f"trained {trainer.global_step} steps, last loss {loss:.4f}")


if __name__ == "__main__":
    main()
