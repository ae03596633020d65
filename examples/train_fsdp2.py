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
uses `FullyShardedDataParallel` (FSDP1) instead, `--eval` adds an eval-mode and a no_grad
forward after every step. `--out DIR` saves each rank's gathered full
parameters (`params-RANK.pt`), its peak RSS and step times (`run-RANK.json`); `--dim`, `--layers`
and `--context` size the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from torch import nn

VOCAB, HEADS = 64, 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, checkpoint: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.checkpoint = checkpoint

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, HEADS, dim // HEADS).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim // HEADS)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, dim)
        return x + self.proj(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            x = torch.utils.checkpoint.checkpoint(self.attention, x, use_reentrant=False)
        else:
            x = self.attention(x)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, dim: int, layers: int, context: int, checkpoint: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, checkpoint) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(checkpoint: bool = False, dim: int = 32, layers: int = 2, context: int = 16) -> GPT:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return GPT(dim, layers, context, checkpoint)


def make_batch(step: int, rank: int, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own data; the length changes from step to step."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    length = context - (step % 3) * (context // 5)
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
        gathered[name] = value.detach().cpu().clone()
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL")
    parser.add_argument(
        "--eval", action="store_true", help="after each step: an eval-mode and a no_grad pass"
    )
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--out", help="folder for each rank's gathered parameters and memory")
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    model = make_model(args.checkpoint == "torch", args.dim, args.layers, args.context)
    model = shard(model.to(device), args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    seconds, evaluations = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        ids, targets = (t.to(device) for t in make_batch(step, rank, args.batch, args.context))
        loss = model(ids, targets)
        optimizer.zero_grad()
        loss.backward()  # FSDP reduce-scatters each block's gradients as its backward ends
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step}  loss {loss.item():.4f}", flush=True)
        if args.eval:
            with torch.no_grad():
                model.eval()
                evaluations.append(model(ids, targets).item())
                model.train()  # train mode without gradients, on a shorter batch
                evaluations.append(model(ids[:, :5], targets[:, :5]).item())
    if args.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    else:
        params = full_parameters(model)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(params, os.path.join(args.out, f"params-{rank}.pt"))
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(os.path.join(args.out, f"run-{rank}.json"), "w") as f:
            json.dump(
                {"peak_rss_kib": peak_kib, "step_seconds": seconds, "evaluations": evaluations}, f
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
