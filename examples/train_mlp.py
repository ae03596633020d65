"""A plain training loop; the model class lives in the script itself.

    python -m ort_autopatch --modules __main__:Net --log-level INFO examples/train_mlp.py --steps 30

`__main__:Net` selects the class below: it trains through ONNX Runtime, the script is unchanged,
and with `--log-level INFO` a summary at exit shows how many calls ran in ORT and how many graphs
were exported. Without the launcher (`python examples/train_mlp.py`) it trains eagerly.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2-core machines: no busy-waiting threads

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, features: int = 20, hidden: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, hidden)
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(args.steps * args.batch, 20)
    target = (data[:, :3].sum(1) > 0).long() + (data[:, 3] > 1).long()
    for step, (x, y) in enumerate(
        zip(data.split(args.batch), target.split(args.batch), strict=True)
    ):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        accuracy = (model(data).argmax(1) == target).float().mean().item()
    print(f"train accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
