"""The GPU path's process-group and device set-up, decided by plain functions checked on CPU.

- --async-save's group is gloo whatever the world's backend: the world here is joined with a
  stand-in backend name (a registered gloo-backed backend, playing NCCL's part), so a group
  made with the default backend would not be gloo; a save over that group then round-trips;
- the saving thread's CUDA device: what it sets, for a CUDA and a CPU rank;
- `init_process_group`'s device_id: cuda:LOCAL_RANK on NCCL, none on gloo;
- the CUDA_DEVICE_MAX_CONNECTIONS start-up warning: only on CUDA, TP > 1, overlap on, not "1".
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megapipe.checkpointing.async_save import (
    SAVING_BACKEND,
    AsyncSaver,
    new_saving_group,
    thread_cuda_device,
)
from megapipe.checkpointing.shards import TensorShard
from megapipe.checkpointing.torch_dist import load_sharded
from megapipe.parallel.initialize import (
    MAX_CONNECTIONS_VAR,
    init_kwargs,
    max_connections_warning,
)
from megapipe.testing import run_distributed

STAND_IN = "standin_nccl"  # the world's backend name in the group test: not "gloo"


def _gloo_backed(store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _saving_group(rank: int, world: int, root: str) -> dict:
    """Rejoin the world under the stand-in backend name, then make groups and save."""
    if STAND_IN not in dist.Backend.backend_list:
        dist.Backend.register_backend(STAND_IN, _gloo_backed, devices=["cpu"])
    dist.destroy_process_group()
    dist.init_process_group(
        STAND_IN, init_method=f"file://{root}/rendezvous", rank=rank, world_size=world
    )
    default = dist.new_group()  # what the saver got before: the world's backend
    saving = new_saving_group(timedelta(seconds=60))
    saver = AsyncSaver(saving)
    piece = TensorShard(torch.arange(4.0) + 4 * rank, (4 * rank,), (4 * world,))
    saver.save(f"{root}/ckpt", {"w": [piece]}, {"iteration": 1}, coordinator=rank == 0)
    saver.wait()
    dest = TensorShard(torch.zeros(4), (4 * rank,), (4 * world,))
    load_sharded(f"{root}/ckpt", {"w": [dest]}, group=saving)
    return {
        "world": dist.get_backend(),
        "default": dist.get_backend(default),
        "saving": dist.get_backend(saving),
        "loaded": dest.tensor.tolist(),
        "device": str(saver.device),
    }


def test_saving_group_is_gloo_on_a_world_of_another_backend(tmp_path) -> None:
    results = run_distributed(_saving_group, 2, str(tmp_path), timeout=60)
    for rank, got in enumerate(results):
        assert got["world"] == got["default"] == STAND_IN  # the test can tell them apart
        assert got["saving"] == SAVING_BACKEND == "gloo"
        assert got["loaded"] == [float(4 * rank + i) for i in range(4)]
        assert got["device"] == "cpu"  # no CUDA here: the thread sets no device


def test_saving_thread_sets_the_training_device_on_cuda_only() -> None:
    assert thread_cuda_device(torch.device("cuda", 3)) == 3
    assert thread_cuda_device(torch.device("cuda")) == 0
    assert thread_cuda_device(torch.device("cpu")) is None
    assert AsyncSaver(None, torch.device("cuda", 5)).device == torch.device("cuda", 5)


def test_nccl_joins_eagerly_on_the_local_device_and_gloo_passes_none() -> None:
    assert init_kwargs("nccl", 3) == {"device_id": torch.device("cuda", 3)}
    assert init_kwargs("gloo", 3) == {}


def test_max_connections_warning_only_where_the_overlap_needs_it() -> None:
    cuda_tp2 = dict(device_type="cuda", tp_size=2, tp_comm_overlap=True)
    for value in (None, "8", "32"):
        note = max_connections_warning(value, **cuda_tp2)
        assert note is not None and "\n" not in note
        assert MAX_CONNECTIONS_VAR in note and "--tp-comm-overlap" in note
        assert "--no-async-tensor-model-parallel-allreduce" in note
    assert "is unset" in max_connections_warning(None, **cuda_tp2)
    assert "is '8'" in max_connections_warning("8", **cuda_tp2)
    assert max_connections_warning("1", **cuda_tp2) is None
    quiet = [
        dict(cuda_tp2, device_type="cpu"),  # gloo ranks: no CUDA queues
        dict(cuda_tp2, tp_size=1),  # no TP collectives
        dict(cuda_tp2, tp_comm_overlap=False),  # each collective waited for at once
    ]
    for case in quiet:
        assert max_connections_warning(None, **case) is None, case


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_saver_made_on_a_cuda_thread_remembers_its_device() -> None:
    torch.cuda.set_device(torch.cuda.device_count() - 1)
    torch.zeros(1, device="cuda")  # CUDA initialised on this thread
    expected = torch.device("cuda", torch.cuda.device_count() - 1)
    assert AsyncSaver(None).device == expected
