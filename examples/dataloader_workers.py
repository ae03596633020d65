"""Training with a DataLoader whose 2 workers are started with spawn.

    python -m ort_autopatch --modules __main__:Net examples/dataloader_workers.py

Spawned workers are fresh interpreters: they activate from the environment the launcher exported
(the bootstrap sitecustomize), re-run this script as `__mp_main__` and so patch `Net` there too;
as they never call the model, they never import onnxruntime. `--json` prints what each worker saw.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(-1)


class Points(Dataset):  # type: ignore[type-arg]
    """Random regression data; each item also says what its worker process looked like."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x.sum(1).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        import ort_autopatch

        main = sys.modules["__main__"]
        seen = {
            "pid": os.getpid(),
            "activated": ort_autopatch.installed_config() is not None,
            "net_patched": ort_autopatch.is_patched(main.Net),
            "onnxruntime_imported": "onnxruntime" in sys.modules,
        }
        return self.x[i], self.y[i], json.dumps(seen, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print what the workers saw")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(
        Points(256), batch_size=32, num_workers=2, multiprocessing_context="spawn", shuffle=True
    )
    workers: set[str] = set()
    for epoch in range(args.epochs):
        for x, y, seen in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            workers.update(seen)
        print(f"epoch {epoch}  loss {loss.item():.4f}")
    if args.json:
        print(json.dumps({"workers": sorted(workers), "parent_pid": os.getpid()}))


if __name__ == "__main__":
    main()
