"""DistributedDataParallel on CPU with gloo, for torchrun.

    torchrun --nproc_per_node 2 -m ort_autopatch --modules __main__:Net examples/train_ddp.py
    python -m ort_autopatch --modules __main__:Net -m torch.distributed.run --nproc_per_node 2 \\
        examples/train_ddp.py

Each rank trains on its own half of every global batch; DDP all-reduces (averages) the gradients
that ONNX Runtime computed, so every rank ends with the same parameters, equal to one eager
process training on the whole global batch. `--out DIR` saves each rank's final parameters.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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
    torch.manual_seed(0)  # the same initial parameters on every rank (DDP also broadcasts them)
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
    parser.add_argument("--out", help="folder for each rank's final parameters")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    xs, ys = make_data(args.steps, args.global_batch)
    local = args.global_batch // world
    for step in range(args.steps):
        x = xs[step, rank * local : (rank + 1) * local]
        y = ys[step, rank * local : (rank + 1) * local]
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
        if rank == 0:
            print(f"step {step}  loss {loss.item():.4f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save(state, os.path.join(args.out, f"params-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
