"""A DTensor passed straight to the functional API is refused, naming the argument: its local
block (a ``Shard(0)`` head from FSDP2, say) is not the array the contract describes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import torch_kl


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard", "replicate"])
def test_dtensor_head_is_refused(mesh, placement):
    weight = distribute_tensor(torch.randn(10, 4), mesh, [placement])
    target = torch.softmax(torch.randn(3, 10), -1)
    with pytest.raises(ValueError, match=r"^weight: expected a plain torch.Tensor, got a DTensor"):
        torch_kl.fused_linear_kl_div(torch.randn(3, 4), weight, target, backend="torch")
