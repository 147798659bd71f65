"""The bundled library's distributed op: MoE router experts sharded across ranks, gathered back.

Run by the nightly's ``distributed`` suite against the installed wheel: gloo on
the CPU at world sizes 2 and 4, NCCL on GPUs, through Kiln's file-rendezvous
runner (``kiln.tasks.testing.distributed.run``), which gives every rank a
deadline and names a failing or hung rank with its traceback or stacks.
"""

from __future__ import annotations

import pytest
import torch

from kiln.tasks.testing.distributed import run
from kiln_kernels import router_logits
from kiln_kernels.expert_parallel import expert_shard, router_logits_on_rank

TIMEOUT_S = 120  # the collective itself; starting the ranks has its own start-up deadline


def _inputs(seed: int, tokens: int = 8, experts: int = 16, dim: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, dim, generator=generator), torch.randn(experts, dim, generator=generator))


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_gets_the_unsharded_logits_over_gloo(world_size):
    hidden, weight = _inputs(world_size)
    expected = router_logits(hidden, weight)
    results = run(router_logits_on_rank, world_size, backend="gloo", timeout=TIMEOUT_S, args=(hidden, weight))
    assert len(results) == world_size
    for rank, logits in enumerate(results):
        assert logits.shape == (8, 16) and logits.dtype == torch.float32, rank
        torch.testing.assert_close(logits, expected, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_the_shards_cover_every_expert_once_in_order(world_size):
    shards = [expert_shard(16, world_size, rank) for rank in range(world_size)]
    covered = [e for s in shards for e in range(16)[s]]
    assert covered == list(range(16))


@pytest.mark.parametrize(("experts", "world_size", "rank", "needle"), [
    (10, 4, 0, "do not split evenly over 4 ranks"),
    (16, 4, 4, "rank 4 is not in a group of 4"),
    (16, 0, 0, "not in a group of 0"),
])
def test_a_shard_that_cannot_exist_is_refused(experts, world_size, rank, needle):
    with pytest.raises(ValueError, match=needle):
        expert_shard(experts, world_size, rank)


@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_every_rank_gets_the_unsharded_logits_over_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    hidden, weight = _inputs(7, tokens=64, experts=64, dim=256)
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    expected = router_logits(hidden.cuda(), weight.cuda()).cpu()
    results = run(router_logits_on_rank, 2, backend="nccl", timeout=TIMEOUT_S, args=(hidden, weight, "cuda"))
    for logits in results:
        torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)
