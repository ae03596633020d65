"""A small GPT trained with FSDP2 (`fully_shard` on every block, then on the root), for torchrun.

    torchrun --nproc_per_node 2 -m ort_autopatch --modules __main__:Block examples/train_fsdp2.py

Each rank holds a shard of every parameter; FSDP2 all-gathers a block's parameters before it
runs and reduce-scatters its gradients after its backward. With `Block` selected, every block's
forward and backward run in ONNX Runtime between those collectives. Without the launcher it is a
plain eager FSDP2 script (the reference the tests compare against).

Options: `--reshard-after-forward false` keeps the blocks' parameters gathered from forward to
backward, `--checkpoint torch|wrapper` applies activation checkpointing to the blocks
(`torch.utils.checkpoint` inside the block's forward, or `checkpoint_wrapper` around it),
`--mixed-precision bf16` passes `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`, `--shard root`
applies `fully_shard` to the root only (then select `__main__:GPT` to run it whole), `--fsdp 1`
uses `FullyShardedDataParallel` (FSDP1) instead. `--out DIR` saves each rank's gathered full
parameters (`params-RANK.pt`) and its peak memory (`memory-RANK.json`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, HEADS, LAYERS, CONTEXT = 64, 32, 4, 2, 16


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, checkpoint: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.checkpoint = checkpoint

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=-1)
        q, k, v = (t.view(batch, length, HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(DIM // HEADS)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, DIM)
        return x + self.proj(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            x = torch.utils.checkpoint.checkpoint(self.attention, x, use_reentrant=False)
        else:
            x = self.attention(x)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, checkpoint: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Parameter(torch.randn(CONTEXT, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(checkpoint) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(checkpoint: bool = False) -> GPT:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return GPT(checkpoint)


def make_batch(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own data; the length changes from step to step."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    length = CONTEXT - (step % 3) * 3
    ids = torch.randint(0, VOCAB, (batch, length + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def shard(model: GPT, args: argparse.Namespace) -> nn.Module:
    if args.checkpoint == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    if args.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if args.mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = args.reshard_after_forward == "true"
    if args.shard == "blocks":
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered from all ranks (collective: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    gathered = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        gathered[name] = value.detach().clone()
    return gathered


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    parser.add_argument("--checkpoint", choices=("none", "torch", "wrapper"), default="none")
    parser.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    parser.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    parser.add_argument(
        "--shard", choices=("blocks", "root"), default="blocks", help="fully_shard each block too"
    )
    parser.add_argument("--out", help="folder for each rank's gathered parameters and memory")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard(make_model(args.checkpoint == "torch"), args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        ids, targets = make_batch(step, rank, args.batch)
        loss = model(ids, targets)
        optimizer.zero_grad()
        loss.backward()  # FSDP reduce-scatters each block's gradients as its backward ends
        optimizer.step()
        if rank == 0:
            print(f"step {step}  loss {loss.item():.4f}", flush=True)
    if args.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    else:
        params = full_parameters(model)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(params, os.path.join(args.out, f"params-{rank}.pt"))
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(os.path.join(args.out, f"memory-{rank}.json"), "w") as f:
            json.dump({"peak_rss_kib": peak_kib}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
