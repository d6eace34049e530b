"""torch_dist checkpoint I/O: DCP round trip, resharding, errors, checksums, refused pickles,
and atomicity when the saving process is SIGKILLed at every fsync/rename point."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.shards import ShardedState, TensorShard
from megapipe.checkpointing.torch_dist import (
    load_common,
    load_sharded,
    read_metadata,
    save_sharded,
    sharded_keys,
    verify_checkpoint,
)
from megapipe.checkpointing.tracker import iteration_dir, read_tracker, write_tracker
from megapipe.testing import run_distributed
from tests.helpers import Evil, refresh_checksums

SHAPES = {"a": (8, 6), "fc1": (8, 4)}  # fc1: SwiGLU [gate; up], two pieces per rank


def full(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The logical tensor `name`: random but a function of the name only."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g).to(dtype)


def rows(name: str, rank: int, world: int, source: torch.Tensor | None = None) -> TensorShard:
    """Rows [rank*n/world, (rank+1)*n/world) of `name`, a view of `source` (zeros if None)."""
    shape = SHAPES[name]
    step = shape[0] // world
    src = torch.zeros(shape) if source is None else source
    return TensorShard(src[rank * step : (rank + 1) * step], (rank * step, 0), shape)


def cols(name: str, rank: int, world: int, source: torch.Tensor | None = None) -> TensorShard:
    shape = SHAPES[name]
    step = shape[1] // world
    src = torch.zeros(shape) if source is None else source
    return TensorShard(src[:, rank * step : (rank + 1) * step], (0, rank * step), shape)


def swiglu(rank: int, world: int, source: torch.Tensor) -> list[TensorShard]:
    """Rank r holds its gate rows and its up rows of fc1 (two pieces of one tensor)."""
    half = SHAPES["fc1"][0] // 2
    step = half // world
    return [
        TensorShard(source[o + rank * step : o + (rank + 1) * step], (o + rank * step, 0), (8, 4))
        for o in (0, half)
    ]


def saved_state(rank: int, world: int) -> ShardedState:
    """What a rank of a `world`-rank save contributes (row splits, SwiGLU pieces, a scalar)."""
    state = {"a": [rows("a", rank, world, full("a"))], "fc1": swiglu(rank, world, full("fc1"))}
    if rank == 0:
        state["step"] = [TensorShard(torch.tensor(7), (), ())]
    return state


def _save(rank: int, world: int, directory: str) -> None:
    common = {"iteration": 3, "args": {"lr": 1e-4, "names": ["x"]}, "t": torch.arange(3)}
    save_sharded(directory, saved_state(rank, world), common, group=_world(), coordinator=rank == 0)


def _world() -> dist.ProcessGroup:
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint saved at 2 ranks (rows 0-3 | 4-7)."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "iter_0000003")
    run_distributed(_save, 2, directory, timeout=60)
    return directory


def test_files_metadata_json_and_common(ckpt: str) -> None:
    names = set(os.listdir(ckpt))
    assert names == {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "metadata.json",
        "checksums.json",
    }
    with open(os.path.join(ckpt, "metadata.json")) as f:
        assert json.load(f) == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
    assert not [n for n in os.listdir(os.path.dirname(ckpt)) if ".tmp-" in n or ".old-" in n]
    common = load_common(ckpt)
    assert common["iteration"] == 3 and common["args"] == {"lr": 1e-4, "names": ["x"]}
    assert torch.equal(common["t"], torch.arange(3))
    assert sharded_keys(ckpt) == {"a": (8, 6), "fc1": (8, 4), "step": ()}
    verify_checkpoint(ckpt)


def _load_same(rank: int, world: int, directory: str) -> bool:
    a, fc1 = torch.zeros(8, 6), torch.zeros(8, 4)
    step = torch.tensor(0)
    state = {"a": [rows("a", rank, world, a)], "fc1": swiglu(rank, world, fc1)}
    state["step"] = [TensorShard(step, (), ())]
    assert load_sharded(directory, state, group=_world()) == {}
    mine = [p.tensor for p in state["a"] + state["fc1"]]
    want = [p.tensor for p in saved_state(rank, world)["a"] + saved_state(rank, world)["fc1"]]
    return all(torch.equal(m, w) for m, w in zip(mine, want)) and int(step) == 7


def test_round_trip_bit_exact(ckpt: str) -> None:
    assert run_distributed(_load_same, 2, ckpt, timeout=60) == [True, True]


def _load_split(rank: int, world: int, directory: str, split: str) -> dict:
    a, fc1 = torch.zeros(8, 6), torch.zeros(8, 4, dtype=torch.bfloat16)
    cut = rows if split == "rows" else cols
    # fc1 in bf16: an fp32 checkpoint loads with a conversion that is reported
    state = {"a": [cut("a", rank, world, a)], "fc1": [cut("fc1", rank, world, fc1)]}
    conversions = load_sharded(directory, state, group=_world())
    return {
        "a": bool(torch.equal(state["a"][0].tensor, cut("a", rank, world, full("a")).tensor)),
        "fc1": bool(
            torch.equal(
                state["fc1"][0].tensor,
                cut("fc1", rank, world, full("fc1").to(torch.bfloat16)).tensor,
            )
        ),
        "conversions": conversions,
    }


@pytest.mark.parametrize("split", ["rows", "cols"])
def test_reshard_2_to_4_ranks(ckpt: str, split: str) -> None:
    for out in run_distributed(_load_split, 4, ckpt, split, timeout=60):
        assert out == {
            "a": True,
            "fc1": True,
            "conversions": {"fc1": (torch.float32, torch.bfloat16)},
        }


def test_reshard_to_one_process_without_process_group(ckpt: str) -> None:
    a = torch.zeros(8, 6)
    fc1 = torch.zeros(8, 4, dtype=torch.float64)
    # asks for fc1 as three uneven row pieces, a in one piece
    state = {
        "a": [TensorShard(a, (0, 0), (8, 6))],
        "fc1": [
            TensorShard(fc1[0:3], (0, 0), (8, 4)),
            TensorShard(fc1[3:5], (3, 0), (8, 4)),
            TensorShard(fc1[5:8], (5, 0), (8, 4)),
        ],
    }
    assert load_sharded(ckpt, state, group=None) == {"fc1": (torch.float32, torch.float64)}
    assert torch.equal(a, full("a")) and torch.equal(fc1, full("fc1").double())


def _load_bad(rank: int, world: int, directory: str, bad: str) -> str:
    """Rank 1 alone asks for something wrong; every rank must raise the same error."""
    state: ShardedState = {"a": [rows("a", rank, world)]}
    if rank == 1 and bad == "missing":
        state["decoder.layers.0.mlp.linear_fc2.weight"] = [TensorShard(torch.zeros(2), (0,), (2,))]
    if rank == 1 and bad == "shape":
        state["fc1"] = [TensorShard(torch.zeros(16, 4), (0, 0), (16, 4))]
    try:
        load_sharded(directory, state, group=_world())
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_missing_key_and_shape_mismatch_raise_on_every_rank(ckpt: str) -> None:
    missing = run_distributed(_load_bad, 2, ckpt, "missing", timeout=60)
    assert missing[0] == missing[1]
    assert "decoder.layers.0.mlp.linear_fc2.weight is missing" in missing[0] and ckpt in missing[0]
    shape = run_distributed(_load_bad, 2, ckpt, "shape", timeout=60)
    assert (
        shape
        == [
            f"checkpoint {ckpt}: tensor fc1 has global shape (8, 4) in the checkpoint, (16, 4) "
            "in this model"
        ]
        * 2
    )


def _save_bad(rank: int, world: int, directory: str, bad: str) -> str:
    state = saved_state(rank, world)
    if bad == "overlap":
        state["a"] = [rows("a", 0, world, full("a"))]  # both ranks save rows 0-3
    if bad == "hole" and rank == 1:
        del state["a"]
    try:
        save_sharded(
            directory,
            state,
            None,
            group=_world(),
            coordinator=rank == 0 or bad == "two-coordinators",
        )
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("overlap", "tensor a: pieces at (0, 0) and (0, 0) overlap"),
        ("hole", "tensor a of shape (8, 6): the saved pieces cover 24 of 48 elements"),
        ("two-coordinators", "2 ranks say they are the coordinator"),
    ],
)
def test_bad_saves_fail_everywhere_and_leave_nothing(tmp_path, bad: str, needle: str) -> None:
    directory = str(tmp_path / "iter_0000001")
    errors = run_distributed(_save_bad, 2, directory, bad, timeout=60)
    assert errors[0] == errors[1] and needle in errors[0], errors
    assert os.listdir(tmp_path) == []  # no temp directory left either
    assert not os.path.exists(directory)


def _copy(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _load_all(directory: str) -> None:
    state = {"a": [TensorShard(torch.zeros(8, 6), (0, 0), (8, 6))]}
    load_sharded(directory, state, group=None)


def test_checksum_failures_name_the_file(ckpt: str, tmp_path) -> None:
    d = _copy(ckpt, str(tmp_path / "trunc"))
    shard = os.path.join(d, "__1_0.distcp")
    os.truncate(shard, os.path.getsize(shard) - 10)
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: \d+ bytes, \d+ when saved"):
        _load_all(d)

    d = _copy(ckpt, str(tmp_path / "flip"))
    _flip_bit(os.path.join(d, "__0_0.distcp"), os.path.getsize(os.path.join(d, "__0_0.distcp")) - 5)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: sha256 .* differs"):
        _load_all(d)

    d = _copy(ckpt, str(tmp_path / "flipmeta"))
    _flip_bit(os.path.join(d, ".metadata"), 40)
    with pytest.raises(CheckpointError, match=r"\.metadata: sha256"):
        sharded_keys(d)
    _flip_bit(os.path.join(d, "common.pt"), 100)
    with pytest.raises(CheckpointError, match=r"common\.pt: sha256"):
        load_common(d)

    d = _copy(ckpt, str(tmp_path / "gone"))
    os.unlink(os.path.join(d, "__1_0.distcp"))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: missing"):
        _load_all(d)
    with pytest.raises(CheckpointError, match=r"unlisted|missing"):
        verify_checkpoint(d)

    d = _copy(ckpt, str(tmp_path / "nosums"))
    os.unlink(os.path.join(d, "checksums.json"))
    with pytest.raises(CheckpointError, match=r"checksums\.json: missing"):
        _load_all(d)
    _load_all_unverified = load_sharded(  # a foreign (e.g. Megatron-Core) checkpoint
        d,
        {"a": [TensorShard(torch.zeros(8, 6), (0, 0), (8, 6))]},
        group=None,
        require_checksums=False,
    )
    assert _load_all_unverified == {}


def _load_rank(rank: int, world: int, directory: str) -> str:
    try:
        # same split as saved: rank 0 reads only __0_0, rank 1 only the corrupted __1_0
        load_sharded(directory, {"a": [rows("a", rank, world)]}, group=_world())
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_corrupt_file_read_by_one_rank_fails_both(ckpt: str, tmp_path) -> None:
    d = _copy(ckpt, str(tmp_path / "one"))
    os.truncate(os.path.join(d, "__1_0.distcp"), 100)
    errors = run_distributed(_load_rank, 2, d, timeout=60)
    assert errors[0] == errors[1] and "__1_0.distcp: 100 bytes" in errors[0]


def test_malicious_metadata_pickle_is_refused(ckpt: str, tmp_path) -> None:
    marker = tmp_path / "pwned"
    d = _copy(ckpt, str(tmp_path / "evilmeta"))
    with open(os.path.join(d, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # our own, trusted
    metadata.planner_data = {"x": Evil(str(marker))}
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    refresh_checksums(d)
    for attempt in (lambda: sharded_keys(d), lambda: _load_all(d)):
        with pytest.raises(CheckpointError, match=r"\.metadata: refused to unpickle posix\.system"):
            attempt()
    assert not marker.exists()
    # control: the payload is live, plain pickle would have run it
    with open(os.path.join(d, ".metadata"), "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_malicious_common_pickle_is_refused(ckpt: str, tmp_path) -> None:
    marker = tmp_path / "pwned"
    d = _copy(ckpt, str(tmp_path / "evilcommon"))
    torch.save({"iteration": 3, "x": Evil(str(marker))}, os.path.join(d, "common.pt"))
    refresh_checksums(d)
    with pytest.raises(CheckpointError, match=r"common\.pt: refused by weights_only"):
        load_common(d)
    assert not marker.exists()
    torch.load(os.path.join(d, "common.pt"), weights_only=False)  # control: it is live
    assert marker.exists()


def test_common_that_would_not_load_safely_is_refused_at_save(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="weights_only loading refuses"):
        save_sharded(
            str(tmp_path / "x"), {}, {"obj": Evil("nothing")}, group=None, coordinator=True
        )
    assert os.listdir(tmp_path) == []


def test_tracker(tmp_path) -> None:
    save = str(tmp_path)
    assert iteration_dir(save, 100) == os.path.join(save, "iter_0000100")
    assert read_tracker(save) is None
    with pytest.raises(CheckpointError, match="iter_0000005 does not exist"):
        write_tracker(save, 5)
    os.mkdir(iteration_dir(save, 5))
    write_tracker(save, 5)
    assert read_tracker(save) == 5
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12a\n")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration\.txt: holds '12a'"):
        read_tracker(save)


# --- atomicity under SIGKILL ---------------------------------------------------------------

BIG = (256, 64)


def _big(seed: int) -> torch.Tensor:
    return torch.randn(BIG, generator=torch.Generator().manual_seed(seed))


def _save_iteration(save: str, iteration: int) -> None:
    w = _big(iteration)
    shards = {"w": [TensorShard(w[:100], (0, 0), BIG), TensorShard(w[100:], (100, 0), BIG)]}
    save_sharded(
        iteration_dir(save, iteration),
        shards,
        {"iteration": iteration},
        group=None,
        coordinator=True,
    )
    write_tracker(save, iteration)


def _child(save: str, iteration: int, kill_at: int, counter) -> None:
    """Save, SIGKILLing itself just before the `kill_at`-th fsync or rename (0: never)."""
    torch.set_num_threads(1)
    calls = 0
    real = {"fsync": os.fsync, "replace": os.replace, "rename": os.rename}

    def hooked(name):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            counter.value = calls
            if calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real[name](*args, **kwargs)

        return call

    for name in real:
        setattr(os, name, hooked(name))
    _save_iteration(save, iteration)
    os._exit(0)


def _check_consistent(save: str) -> int:
    """The tracker's iteration loads bit-exact; any iter_* under its final name verifies."""
    latest = read_tracker(save)
    assert latest is not None
    for name in os.listdir(save):
        if name.startswith("iter_") and "." not in name:
            verify_checkpoint(os.path.join(save, name))
    w = torch.zeros(BIG)
    load_sharded(iteration_dir(save, latest), {"w": [TensorShard(w, (0, 0), BIG)]}, group=None)
    assert torch.equal(w, _big(latest))
    assert load_common(iteration_dir(save, latest)) == {"iteration": latest}
    return latest


def _run_child(save: str, iteration: int, kill_at: int = 0, delay: float | None = None) -> int:
    ctx = mp.get_context("fork")
    counter = ctx.Value("i", 0)
    proc = ctx.Process(target=_child, args=(save, iteration, kill_at, counter))
    proc.start()
    if delay is not None:
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode is not None
    return counter.value if proc.exitcode == 0 else -1


@pytest.mark.slow
def test_sigkill_at_every_sync_point_leaves_a_loadable_checkpoint(tmp_path) -> None:
    save = str(tmp_path / "save")
    _save_iteration(save, 1)
    points = _run_child(str(tmp_path / "dry"), 1)  # count the fsync/rename calls of one save
    assert points >= 8, points
    outcomes = set()
    for kill_at in range(1, points + 1):
        _run_child(save, 2, kill_at)
        outcomes.add(_check_consistent(save))
        if os.path.exists(iteration_dir(save, 2)):  # start the next kill point from iteration 1
            write_tracker_back(save)
    assert outcomes == {1, 2}  # kills before the tracker rename keep 1; the last ones see 2
    # overwriting an existing iteration: killed anywhere, the next save of it restores or redoes
    for kill_at in range(1, points + 1):
        _run_child(save, 1, kill_at)
        atomic_dir.clear_stale(iteration_dir(save, 1))
        assert _check_consistent(save) == 1
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1):
        _run_child(save, 2, delay=delay)
        _check_consistent(save)
    _save_iteration(save, 2)
    assert _check_consistent(save) == 2
    assert sorted(os.listdir(save)) == [
        "iter_0000001",
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]


def write_tracker_back(save: str) -> None:
    """Undo a (partly) completed save of iteration 2: the next kill point starts from 1 again."""
    import shutil

    if read_tracker(save) == 2:
        write_tracker(save, 1)
    shutil.rmtree(iteration_dir(save, 2))


# --- async save ---------------------------------------------------------------------------


def _async(rank: int, world: int, save: str) -> list[bool]:
    from megapipe.checkpointing.async_save import AsyncSaver

    ckpt_group, train_group = _world(), _world()
    saver = AsyncSaver(ckpt_group)
    w = full("a")
    results = []
    for iteration in (1, 2):
        piece = rows("a", rank, world, w)
        saver.save(
            iteration_dir(save, iteration),
            {"a": [piece]},
            {"iteration": iteration},
            coordinator=rank == 0,
            then=(lambda it=iteration: write_tracker(save, it)) if rank == 0 else None,
        )
        piece.tensor.add_(1.0)  # training goes on: the staged copy must not see this
        t = torch.ones(1)
        dist.all_reduce(t, group=train_group)  # collectives on another group meanwhile
        results.append(float(t) == world)
    saver.wait()
    dist.barrier(train_group)
    for iteration in (1, 2):
        dest = rows("a", rank, world)
        load_sharded(iteration_dir(save, iteration), {"a": [dest]}, group=ckpt_group)
        results.append(
            torch.equal(dest.tensor, rows("a", rank, world, full("a") + (iteration - 1)).tensor)
        )
    results.append(read_tracker(save) == 2)
    return results


def test_async_save_stages_a_copy_and_keeps_one_in_flight(tmp_path) -> None:
    assert run_distributed(_async, 2, str(tmp_path), timeout=60) == [[True] * 5] * 2


def _save_bytes(rank: int, world: int, directory: str, same: bool) -> str:
    """Each rank writes its rows of `a` and one byte entry (with `same`, both the same one)."""
    name = "obj/shard_0_2" if same else f"obj/shard_{rank}_2"
    try:
        save_sharded(
            directory, {"a": [rows("a", rank, world, full("a"))]}, {"iteration": 1},
            group=dist.group.WORLD, coordinator=rank == 0, objects={name: b"rank%d" % rank},
        )  # fmt: skip
    except CheckpointError as e:
        return str(e)
    return ""


def test_byte_entries_are_written_once_and_never_read(tmp_path) -> None:
    directory = str(tmp_path / "bytes")
    assert run_distributed(_save_bytes, 2, directory, False) == ["", ""]
    metadata = read_metadata(directory)
    assert sorted(k for k in metadata.state_dict_metadata if k.startswith("obj/")) == [
        "obj/shard_0_2", "obj/shard_1_2",
    ]  # fmt: skip
    assert set(sharded_keys(directory)) == {"a"}  # the tensors only
    dest = {"a": [TensorShard(torch.zeros(8, 6), (0, 0), (8, 6))]}
    load_sharded(directory, dest, group=None)  # the byte entries are not read
    assert torch.equal(dest["a"][0].tensor, full("a"))
    errors = run_distributed(_save_bytes, 2, str(tmp_path / "twice"), True)
    assert all("entry obj/shard_0_2 is written by rank 0 and rank 1" in e for e in errors), errors
    assert not os.path.exists(tmp_path / "twice")
