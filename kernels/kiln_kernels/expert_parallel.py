"""Expert-parallel MoE routing: the router's experts sharded across ranks.

Each rank holds a contiguous block of the router weight's rows (its experts)
and computes their logits with :func:`kiln_kernels.router_logits` (the fused
kernel where the platform has one); an all-gather over the process group
assembles the full ``(T, E)`` logits on every rank, experts in global order.
Works with any ``torch.distributed`` backend: gloo on the CPU, NCCL on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln_kernels.router import router_logits


def expert_shard(num_experts: int, world_size: int, rank: int) -> slice:
    """The rows of the router weight that ``rank`` holds: a contiguous, equal block."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"expert_shard: rank {rank} is not in a group of {world_size}")
    if num_experts % world_size:
        raise ValueError(f"expert_shard: {num_experts} experts do not split evenly over {world_size} ranks")
    size = num_experts // world_size
    return slice(rank * size, (rank + 1) * size)


def sharded_router_logits(hidden: torch.Tensor, weight_shard: torch.Tensor,
                          group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``(T, D)`` hidden × this rank's ``(E / world, D)`` experts -> the full ``(T, E)`` float32 logits.

    Every rank of ``group`` must call it with the same ``hidden`` and its own shard (a collective).
    """
    local = router_logits(hidden, weight_shard).contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.cat(gathered, dim=1)


def router_logits_on_rank(rank: int, world_size: int, hidden: torch.Tensor, weight: torch.Tensor,
                          device: str = "cpu") -> torch.Tensor:
    """A rank's whole step in an initialised default group (a picklable entry for a rank launcher):
    take this rank's shard of ``weight``, route on ``device`` (``"cuda"``: the GPU numbered by the
    rank), gather, and return the full logits on the CPU."""
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"router_logits_on_rank: called as rank {rank} of {world_size} in a group where it is "
                         f"rank {dist.get_rank()} of {dist.get_world_size()}")
    target = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    shard = weight[expert_shard(weight.shape[0], world_size, rank)]
    return sharded_router_logits(hidden.to(target), shard.to(target)).cpu()
