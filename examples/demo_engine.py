"""Train the same small classifier eagerly and through ONNX Runtime; print the losses side by side.

Run with `nox -s demo`. The two columns should agree to about six digits: the model has no
dropout, so ONNX Runtime computes the same function and the same gradients as PyTorch.
"""

from __future__ import annotations

import copy
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import nn

from ort_autopatch.engine import ModuleEngine


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            # bias=False before BatchNorm: the bias gradient is pure rounding noise there,
            # which AdamW would amplify into diverging running means in both runs.
            nn.Linear(20, 64, bias=False),
            nn.BatchNorm1d(64),
            nn.GELU(),
            nn.Linear(64, 64),
            nn.ReLU(),
        )
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.body(x)))
        return nn.functional.cross_entropy(logits, target)


def main() -> None:
    torch.manual_seed(0)
    eager = Classifier()
    accelerated = copy.deepcopy(eager)
    engine = ModuleEngine(accelerated)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_ort = torch.optim.AdamW(accelerated.parameters(), lr=1e-2)
    data = torch.randn(512, 20)
    target = (data[:, :3].sum(1) > 0).long() + (data[:, 3] > 1).long()

    print(f"{'step':>4}  {'eager loss':>12}  {'ORT loss':>12}  {'|diff|':>9}")
    first_call = 0.0
    for step in range(20):
        idx = torch.randint(0, len(data), (64,))
        x, y = data[idx], target[idx]
        losses = []
        for opt, run in ((opt_eager, eager), (opt_ort, engine)):
            opt.zero_grad()
            start = time.perf_counter()
            loss = run(x, y)
            if step == 0 and run is engine:
                first_call = time.perf_counter() - start
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(
            f"{step:>4}  {losses[0]:>12.6f}  {losses[1]:>12.6f}  {abs(losses[0] - losses[1]):>9.2e}"
        )
    accelerated.eval()
    eager.eval()
    with torch.no_grad():
        x, y = data[:128], target[:128]
        print(f"eval loss: eager {eager(x, y).item():.6f}  ORT {engine(x, y).item():.6f}")
    print(
        f"graphs built: {engine.builds} (train + eval); first call (export + gradient build + "
        f"session): {first_call:.3f}s"
    )


if __name__ == "__main__":
    main()
