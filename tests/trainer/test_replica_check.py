"""The replica check catches processes whose copies of the weights drifted apart (a missing all-reduce)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kubetune_api.ports import free_listen_port
from kubetune_trainer.training.consistency import ReplicasDiverged, check_replicas_agree


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


def train_two_replicas(rank: int, port: int, all_reduce: bool, results) -> None:
    """Two processes, one linear layer, different data: gradients averaged, or not."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    inputs = torch.full((3, 4), float(rank + 1))  # each process sees other samples
    layer(inputs).pow(2).mean().backward()
    if all_reduce:
        for param in layer.parameters():
            dist.all_reduce(param.grad)
            param.grad /= 2
    optimizer.step()
    try:
        check_replicas_agree(list(layer.named_parameters()), gather)
        results[rank] = "agree"
    except ReplicasDiverged as err:
        results[rank] = str(err)
    dist.destroy_process_group()


def replicas_after_one_step(all_reduce: bool) -> dict:
    results = mp.Manager().dict()
    mp.spawn(train_two_replicas, args=(free_listen_port(), all_reduce, results), nprocs=2)
    return dict(results)


def test_replicas_that_averaged_their_gradients_agree():
    assert replicas_after_one_step(all_reduce=True) == {0: "agree", 1: "agree"}


def test_replicas_without_an_all_reduce_are_caught_on_every_process_naming_the_parameter():
    results = replicas_after_one_step(all_reduce=False)
    for message in results.values():
        assert "weight differs between rank 0 and rank 1" in message
        assert "gradients were not averaged over every process" in message
