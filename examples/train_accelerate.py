"""Hugging Face Accelerate on CPU: the loop `accelerate launch` runs, unchanged.

    ORT_AUTOPATCH_MODULES=__main__:Net PYTHONPATH=sitecustomize_example \\
        accelerate launch --cpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/train_accelerate.py

`sitecustomize_example/` on PYTHONPATH activates the tool in every process accelerate starts,
from the ORT_AUTOPATCH_* variables (`python -m ort_autopatch ... -m accelerate.commands.launch`
works too). Each process trains on its own half of every global batch; `accelerator.prepare`
wraps the model in DistributedDataParallel, which averages the gradients ONNX Runtime computed,
so every process ends with the parameters of one eager process training on the whole batch.
`--out DIR` saves each process's final parameters.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from accelerate import Accelerator
from torch import nn

FEATURES = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.layers(x), y)


def make_model() -> Net:
    torch.manual_seed(0)  # the same initial parameters in every process
    return Net()


def make_data(steps: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps, global_batch, FEATURES, generator=generator)
    y = torch.randint(0, 4, (steps, global_batch), generator=generator)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--out", help="folder for each process's final parameters")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank, world = accelerator.process_index, accelerator.num_processes
    xs, ys = make_data(args.steps, args.global_batch)
    local = args.global_batch // world
    for step in range(args.steps):
        x = xs[step, rank * local : (rank + 1) * local]
        y = ys[step, rank * local : (rank + 1) * local]
        loss = model(x, y)
        optimizer.zero_grad()
        accelerator.backward(loss)  # DDP averages the gradients across processes here
        optimizer.step()
        accelerator.print(f"step {step}  loss {loss.item():.4f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        state = accelerator.unwrap_model(model).state_dict()
        torch.save(
            {k: v.detach().clone() for k, v in state.items()},
            os.path.join(args.out, f"params-{rank}.pt"),
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
