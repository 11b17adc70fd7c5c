"""torch.distributed for training: one process per device, launched by ``torchrun``.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them everything here is a no-op and
training runs in one process. Gradients are averaged by DistributedDataParallel (gloo on CPU,
NCCL on GPU); the helpers below average what the loop reports and gather per-rank state.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from selfattn.errors import SelfAttnError, SettingsError


@dataclass(frozen=True)
class Context:
    """Where this process stands: its rank among ``world_size`` and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    joined: bool = False  # setup() created the process group, so the run's end leaves it

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints and prints progress."""
        return self.rank == 0


DEVICES = ("auto", "cpu", "cuda")  # "cuda": each process the GPU of its LOCAL_RANK


def check_device(device: object) -> None:
    """A one-line error unless ``device`` is one of :data:`DEVICES` ("cuda:0" too: it would
    give every process of a distributed run the same GPU)."""
    if device not in DEVICES:
        raise SettingsError(
            f"unknown device {device!r}; choose auto, cpu or cuda (each process then takes the "
            "GPU of its LOCAL_RANK)"
        )


def setup(device: str = "auto") -> Context:
    """Join the process group when launched by torchrun; pick the device ("auto", "cpu", "cuda")."""
    check_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda" and not torch.cuda.is_available():
        raise SelfAttnError("--device cuda: no CUDA device is available here; use --device cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        chosen = torch.device("cuda", local_rank)
        torch.cuda.set_device(chosen)
    else:
        chosen = torch.device("cpu")
    joined = world_size > 1 and not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    return Context(rank, world_size, local_rank, chosen, joined)


def teardown() -> None:
    """Leave the process group, if this process joined one.

    Garbage is collected first: a DistributedDataParallel model sits in a reference cycle, so
    without it the model (and the group it holds) outlives the group's destruction until
    interpreter exit, where its teardown could abort the process ("terminate called without
    an active exception", SIGABRT, seen once in about 60 two-rank runs)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def wrap(model: nn.Module, context: Context) -> nn.Module:
    """The model under DistributedDataParallel when there are several processes, else as is."""
    if context.world_size == 1:
        return model
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def mean_across_ranks(value: Tensor) -> Tensor:
    """The mean of a tensor over all ranks (the tensor itself in one process)."""
    if not dist.is_initialized():
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def any_across_ranks(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any (so all ranks stop at the same step)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
