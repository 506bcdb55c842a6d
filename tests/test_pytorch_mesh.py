"""PyTorch's DeviceMesh as per-rank programs use it: meshes over a subset of the ranks (one
device per process, ids = global ranks), get_group on a size-1 dim, ``_unflatten``, ``with
mesh:`` as the current mesh, the error for torch.distributed collectives called on a DTensor,
and veScale plans whose keys escape their dots. The oracle is single-device PyTorch and, for
process groups, torch's own DeviceMesh run beside ours."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import DeviceMesh, Partial, Replicate, Shard
from shardwise.errors import MeshError
from shardwise.parallel import distribute_module, parallelize_module

# ----- _unflatten (embedded) -----------------------------------------------------------------


def test_unflatten_splits_a_dim_into_named_dims():
    world = DeviceMesh("cpu", list(range(8)), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (2, 2, 2), ("dp", "cp", "tp"))
    ids = torch.arange(8).reshape(2, 2, 2)
    assert mesh.mesh.tolist() == ids.tolist()
    assert mesh.mesh_dim_names == ("dp", "cp", "tp")
    for d, name in enumerate(("dp", "cp", "tp")):  # the groups are the rows of the id array
        rows = ids.movedim(d, -1).reshape(-1, 2).tolist()
        assert mesh.groups(name) == [tuple(r) for r in rows]
    # a dim in the middle of a 2-D mesh, named by its name
    two = sw.init_device_mesh("cpu", (2, 6), mesh_dim_names=("dp", "tp"))
    split = two._unflatten("tp", (3, 2), ("a", "b"))
    assert split.mesh.tolist() == torch.arange(12).reshape(2, 3, 2).tolist()
    assert split.mesh_dim_names == ("dp", "a", "b")
    assert split.groups("a")[0] == (0, 2, 4) and split.group_of(7, "dp") == (1, 7)
    # sharding over the split dims is sharding over the devices of the original dim
    t = torch.arange(48.0).reshape(12, 4)
    dt = sw.distribute_tensor(t, split, [Replicate(), Shard(0), Shard(1)])
    assert torch.equal(dt.full_tensor(), t)
    assert torch.equal(sw.tf.unpack(dt)[3], t.chunk(3, 0)[1].chunk(2, 1)[1])


def test_unflatten_errors_name_the_mesh():
    world = DeviceMesh("cpu", list(range(8)), mesh_dim_names=("world",))
    with pytest.raises(MeshError, match=r"multiply to 6.*8 devices"):
        world._unflatten(0, (2, 3), ("a", "b"))
    with pytest.raises(MeshError, match="as many mesh_dim_names"):
        world._unflatten(0, (2, 4), ("a",))
    with pytest.raises(MeshError, match="'nope'"):
        world._unflatten("nope", (2, 4), ("a", "b"))
    with pytest.raises(MeshError, match="mesh_dim_names"):
        DeviceMesh("cpu", list(range(4)))._unflatten(0, (2, 2), ("a", "b"))
    with pytest.raises(MeshError, match="unique"):
        world._unflatten(0, (2, 4), ("a", "a"))
    with pytest.raises(MeshError, match=r"key 'c' is no new dim.*\('a', 'b'\)"):
        world._unflatten(0, (2, 4), ("a", "b"), backend_override={"c": "fake"})
    with pytest.raises(MeshError, match=r"key 2 is no new dim"):
        world._unflatten(0, (2, 4), ("a", "b"), backend_override={2: "gloo"})
    with pytest.raises(MeshError, match="twice"):
        world._unflatten(0, (2, 4), ("a", "b"), backend_override={"b": "fake", 1: "gloo"})


def test_unflatten_takes_a_backend_override_as_torchtitan_passes_it():
    """torchtitan's ParallelDims gives its unused dims PyTorch's "fake" backend; the mesh is the
    one without the override (shardwise picks each group's transport itself)."""
    world = DeviceMesh("cpu", list(range(8)), mesh_dim_names=("world",))
    names = ("pp", "dp", "cp", "tp")
    plain = world._unflatten(0, (1, 2, 1, 4), names)
    for override in ({"pp": "fake", "cp": "fake"}, {0: "fake", "tp": ("gloo", None)}, {}):
        mesh = world._unflatten(0, (1, 2, 1, 4), names, backend_override=override)
        assert mesh == plain and mesh.mesh_dim_names == names


def test_root_mesh_through_unflatten_and_flatten():
    root = sw.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp = root["tp"]
    assert tp.root_mesh is root and tp.root_dims == (1,)
    # a 1-D flatten or a one-dim "split" keeps the root: its dim is the same dim of the root
    renamed = tp.flatten("model")
    assert renamed.root_mesh is root and renamed.root_dims == (1,)
    same = tp._unflatten(0, (4,), ("tp2",))
    assert same.root_mesh is root and same.root_dims == (1,)
    # split or merged dims are no dims of the root: the new mesh is a root, its sub-meshes
    # remember it
    split = tp._unflatten(0, (2, 2), ("a", "b"))
    assert split.root_mesh is split and split.root_dims == (0, 1)
    assert split["b"].root_mesh is split and split["b", "a"].root_dims == (1, 0)
    flat = root.flatten()
    assert flat.root_mesh is flat and flat["dp_tp"].root_mesh is flat


# ----- with mesh: (embedded) ---------------------------------------------------------------


def test_with_mesh_is_the_current_mesh_of_the_apis_that_read_it():
    mesh = sw.init_device_mesh("cpu", (2,))
    other = sw.init_device_mesh("cpu", (4,))
    assert sw.tf.get_default_mesh() is None
    with mesh as entered:
        assert entered is mesh and sw.tf.get_default_mesh() is mesh
        z = sw.zeros(4, 2)
        assert z.device_mesh == mesh and z.placements == (Replicate(),)
        r = sw.randn(4, placements=[Shard(0)])
        assert r.device_mesh == mesh
        local = sw.DTensor.from_local(torch.ones(2))
        assert local.device_mesh == mesh and local.placements == (Replicate(),)
        with other:  # nested: the inner one is current, then the outer again
            assert sw.ones(4).device_mesh == other
            with sw.tf.default_mesh(mesh):  # TF's name for the same state
                assert sw.tf.get_default_mesh() is mesh
            assert sw.tf.get_default_mesh() is other
        assert sw.full((2,), 3.0).device_mesh == mesh
        placed = sw.distribute_tensor(torch.arange(4.0), placements=[Shard(0)])
        assert placed.device_mesh == mesh and torch.equal(placed.full_tensor(), torch.arange(4.0))
        lin = distribute_module(nn.Linear(4, 2))
        assert lin.weight.device_mesh == mesh
        col = parallelize_module(nn.Linear(4, 2), parallelize_plan=sw.parallel.ColwiseParallel())
        assert col.weight.placements == (Shard(0),) and col.weight.device_mesh == mesh
    assert sw.tf.get_default_mesh() is None
    with pytest.raises(MeshError, match=r"no device_mesh.*with mesh"):
        sw.zeros(4)
    with pytest.raises(MeshError, match=r"DTensor.from_local.*with mesh"):
        sw.DTensor.from_local(torch.ones(2))
    with pytest.raises(MeshError, match=r"distribute_tensor.*with mesh"):
        sw.distribute_tensor(torch.ones(2))


def test_with_mesh_is_undone_on_error_and_stays_in_its_thread():
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(RuntimeError, match="boom"), mesh:
        raise RuntimeError("boom")
    assert sw.tf.get_default_mesh() is None
    inside, entered, release = [], threading.Event(), threading.Event()

    def other_thread() -> None:
        inside.append(sw.tf.get_default_mesh())  # the main thread's block is not seen here
        two = sw.init_device_mesh("cpu", (4,))
        with two:
            entered.set()
            release.wait(10)
            inside.append(sw.tf.get_default_mesh())

    with mesh:
        worker = threading.Thread(target=other_thread)
        worker.start()
        entered.wait(10)
        assert sw.tf.get_default_mesh() is mesh  # the thread's block is not seen here either
        release.set()
        worker.join(10)
    assert inside[0] is None and inside[1].shape == (4,)


# ----- get_group of a size-1 dim (embedded) --------------------------------------------------


def test_size_one_dim_group_in_one_process_is_a_clear_error():
    mesh = sw.init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(MeshError, match="not initialized"):
        mesh["tp"].get_group()
    with pytest.raises(MeshError, match="lives inside process 0"):
        mesh.get_group("dp")


# ----- veScale plans with escaped dots -----------------------------------------------------


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


ESCAPED_PLAN = {
    "parameter": {
        r"layers\.\d+\.mlp\.w1\.weight": [Shard(0)],
        r"layers\.\d+\.mlp\.w1\.bias": [Shard(0)],
        r"layers\.\d+\.mlp\.w2\.weight": [Shard(1)],
    },
    "forward": {
        r"layers\.\d+\.input": [[Replicate()]],
        r"layers\.\d+\.mlp\.w1\.input": [[Replicate()]],
        r"layers\.\d+\.mlp\.w2\.output": [[Replicate()]],
    },
}


def _check_escaped_plan(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = _Layers()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, ESCAPED_PLAN)
    assert model.layers[1].mlp.w1.weight.placements == (Shard(0),)
    assert model.layers[0].mlp.w2.weight.placements == (Shard(1),)
    x = torch.randn(3, 8)
    out = model(x)
    expected = reference(x)
    assert out.placements == (Replicate(),)
    torch.testing.assert_close(out.full_tensor(), expected)
    out.full_tensor().sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_vescale_plan_with_escaped_dots():
    _check_escaped_plan(sw.init_device_mesh("cpu", (4,)))


def test_vescale_forward_key_without_side_names_it():
    with pytest.raises(sw.errors.ParallelPlanError, match=r"'.input' or '.output'"):
        parallelize_module(_Layers(), sw.init_device_mesh("cpu", (2,)),
                           {"forward": {r"layers\.\d+\.mlp": [[Replicate()]]}})


# ----- across processes ----------------------------------------------------------------------


def _ranks(group: object) -> list[int]:
    return dist.get_process_group_ranks(group)


def _subset_checks(out: dict) -> None:
    """Ranks 0 and 2: a DTensor on DeviceMesh("cpu", [0, 2]) against single-device values."""
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [0, 2])
    out["local"] = mesh.local_device_ids
    out["coordinate"] = mesh.get_coordinate()
    out["group"] = _ranks(mesh.get_group())
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    w = torch.randn(6, 3)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    k = mesh.get_local_rank()
    out["piece"] = torch.equal(dt.to_local(), x.chunk(2, 0)[k])
    out["full"] = torch.equal(dt.full_tensor(), x)
    rep = dt.redistribute(mesh, [Replicate()])
    out["replicate"] = torch.equal(rep.to_local(), x)
    cols = dt.redistribute(mesh, [Shard(1)])  # all_to_all
    out["shard1"] = torch.equal(cols.to_local(), x.chunk(2, 1)[k])
    prod = dt @ sw.distribute_tensor(w, mesh, [Replicate()])
    out["matmul"] = torch.allclose(prod.full_tensor(), x @ w)
    part = sw.DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])
    out["partial_sum"] = part.full_tensor().tolist()  # ranks 0 and 2 give 1 + 3
    out["reduce_scatter"] = part.redistribute(mesh, [Shard(0)]).to_local().tolist()
    checked = sw.DTensor.from_local(torch.full((2,), float(rank)), mesh, run_check=True)
    out["broadcast"] = checked.to_local().tolist()  # Replicate: the first rank's value


def _other_checks(out: dict) -> None:
    """Ranks 1 and 3: a 2-D mesh over them (ids in another order), size-1 dim groups."""
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[3], [1]], mesh_dim_names=("dp", "tp"))
    out["local"] = mesh.local_device_ids
    out["coordinate"] = mesh.get_coordinate()
    out["dp_group"] = _ranks(mesh.get_group("dp"))
    out["tp_group"] = _ranks(mesh["tp"].get_group())  # size 1: this process alone
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    out["tp_sum"] = t.item()
    x = torch.arange(12.0).reshape(4, 3)
    dt = sw.distribute_tensor(x, mesh, [Shard(0), Replicate()], src_data_rank=None)
    out["piece"] = torch.equal(dt.to_local(), x.chunk(2, 0)[mesh.get_local_rank("dp")])
    out["full"] = torch.equal(dt.full_tensor(), x)
    out["gathered"] = torch.equal(dt.redistribute(mesh, [Replicate(), Replicate()]).to_local(), x)


def _four_process_job() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    if rank in (0, 2):
        _subset_checks(out)
    else:
        _other_checks(out)
    # every rank may build a mesh it is not in: it owns none of it
    outside = DeviceMesh("cpu", [0, 2] if rank in (1, 3) else [1, 3])
    out["outside"] = (outside.local_device_ids, outside.get_coordinate())
    # ids 0..N-1 with N a multiple of the world above it keep N/W devices per process
    out["eight"] = DeviceMesh("cpu", list(range(8))).local_device_ids
    out["two"] = DeviceMesh("cpu", [0, 1]).local_device_ids  # fewer ids than ranks: ranks
    for bad in ([0, 5], list(range(6))):
        try:
            DeviceMesh("cpu", bad)
        except MeshError as err:
            out.setdefault("errors", []).append(str(err))
    # _unflatten across processes: its groups are torch's
    world = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    split = world._unflatten(0, (2, 2), ("dp", "tp"))
    out["unflatten_groups"] = [_ranks(split.get_group(d)) for d in ("dp", "tp")]
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    theirs = torch_init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    theirs = theirs._unflatten(0, (2, 2), ("dp", "tp"))
    out["torch_groups"] = [_ranks(theirs.get_group(d)) for d in ("dp", "tp")]
    x = torch.arange(16.0).reshape(4, 4)
    dt = sw.distribute_tensor(x, split, [Shard(0), Shard(1)])
    coord = split.get_coordinate()
    piece = x.chunk(2, 0)[coord[0]].chunk(2, 1)[coord[1]]
    out["unflatten_piece"] = torch.equal(dt.to_local(), piece)
    out["unflatten_full"] = torch.equal(dt.full_tensor(), x)
    return out


def test_meshes_over_some_ranks_across_four_processes():
    results = run_in_processes(_four_process_job, 4, timeout=180)
    for rank, out in enumerate(results):
        assert out["local"] == (rank,)
        assert out["outside"] == ((), None)
        assert out["eight"] == (2 * rank, 2 * rank + 1)
        assert out["two"] == ((rank,) if rank < 2 else ())
        assert "global ranks" in out["errors"][0] and "[0, 5]" in out["errors"][0]
        assert "multiple of the world size" in out["errors"][1]
        assert out["unflatten_groups"] == out["torch_groups"]
        assert out["unflatten_piece"] and out["unflatten_full"]
        assert out["piece"] and out["full"]
        if rank in (0, 2):
            assert out["coordinate"] == (rank // 2,) and out["group"] == [0, 2]
            assert out["replicate"] and out["shard1"] and out["matmul"]
            assert out["partial_sum"] == [4.0] * 4
            assert out["reduce_scatter"] == [4.0] * 2
            assert out["broadcast"] == [0.0, 0.0]
        else:
            assert out["coordinate"] == ({3: (0, 0), 1: (1, 0)}[rank])
            assert out["dp_group"] == [1, 3] and out["tp_group"] == [rank]
            assert out["tp_sum"] == float(rank) and out["gathered"]


def _two_process_job() -> dict:
    rank = dist.get_rank()
    out: dict = {}
    mesh = sw.init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    theirs = torch_init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    out["tp_group"] = (_ranks(mesh["tp"].get_group()), _ranks(mesh.get_group("tp")))
    out["torch_tp_group"] = _ranks(theirs["tp"].get_group())
    out["all_groups"] = [_ranks(g) for g in mesh.get_all_groups()]
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    out["tp_sum"] = t.item()
    # torch.distributed collectives called on a DTensor: what to do instead
    one = sw.init_device_mesh("cpu", (2,))
    dt = sw.distribute_tensor(torch.ones(4, 2), one, [Shard(0)])
    calls = {
        "all_reduce": lambda: dist.all_reduce(dt),
        "all_gather": lambda: dist.all_gather([torch.empty(2, 2), torch.empty(2, 2)], dt),
        "broadcast": lambda: dist.broadcast(dt, src=0),
        "send": lambda: dist.send(dt, dst=1 - rank),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except sw.errors.DTensorCollectiveError as err:
            out[name] = str(err)
    out["to_local_still_works"] = dist.all_reduce(dt.to_local()) is None
    # the escaped veScale plan, one device per process
    _check_escaped_plan(one)
    return out


def test_size_one_groups_and_collectives_on_dtensors_across_two_processes():
    results = run_in_processes(_two_process_job, 2, timeout=180)
    for rank, out in enumerate(results):
        assert out["tp_group"] == ([rank], [rank]) and out["torch_tp_group"] == [rank]
        assert out["all_groups"] == [[0, 1], [rank]]
        assert out["tp_sum"] == rank + 1.0
        where = "shape [4, 2], placements [Shard(dim=0)]"
        for name, op in (("all_reduce", "c10d.allreduce_"), ("all_gather", "c10d.allgather_"),
                         ("broadcast", "c10d.broadcast_"), ("send", "c10d.send")):
            assert op in out[name] and where in out[name] and "to_local()" in out[name]
            assert "DeviceMesh('cpu', [0, 1])" in out[name]
        assert "redistribute(placements=[Replicate()])" in out["all_reduce"]
        assert "full_tensor()" in out["all_gather"]
        assert out["to_local_still_works"]


FAKE_BACKEND = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import shardwise as sw
from shardwise import Replicate, Shard
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = sw.init_device_mesh("cpu", (2, 2))
dt = sw.DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0), Shard(1)])
full = dt.redistribute(mesh, [Replicate(), Replicate()])
back = full.redistribute(mesh, [Shard(0), Shard(1)])
print(tuple(dt.shape), tuple(full.to_local().shape), tuple(back.to_local().shape))
dist.destroy_process_group()
"""


def test_meshes_on_torchs_fake_backend_make_no_gloo_groups() -> None:
    """Shape-only programs on PyTorch's ``fake`` process group (rank 0 of a world of 4 in one
    process, as torch's tests and torchtitan's dry runs use it): sub-mesh groups and the
    host-check groups stay on the fake backend (a gloo group has no peers to meet there), so
    redistributions run and give the global and local shapes."""
    src = Path(__file__).resolve().parent.parent / "src"
    result = subprocess.run(
        [sys.executable, "-c", FAKE_BACKEND], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[0] == "(4, 6) (4, 6) (2, 3)"


# ----- PyTorch's private mesh fields: _init_backend=False, _coordinate_on_dim -----------------


def test_mesh_without_backend_as_torchs() -> None:
    """``DeviceMesh(..., _init_backend=False, _rank=r)``: a mesh of ranks seen from rank r, its
    coordinates known, no process group to ask for (torch's DeviceMesh beside it)."""
    from torch.distributed import device_mesh as torch_mesh

    for ids, rank in ((torch.arange(10), 5), (torch.arange(10).view(2, 5), 7),
                      (torch.arange(6).view(3, 2), 9)):
        ours = DeviceMesh("cpu", ids, _init_backend=False, _rank=rank)
        theirs = torch_mesh.DeviceMesh("cpu", ids, _init_backend=False, _rank=rank)
        coord = theirs._coordinate_on_dim
        assert ours._coordinate_on_dim == coord and ours.get_coordinate() == coord, (ids, rank)
        assert ours.get_rank() == rank and not dist.is_initialized()
        for mesh in (ours, theirs):
            with pytest.raises(RuntimeError, match="process groups not initialized"):
                mesh.get_group(0)
    with pytest.raises(sw.errors.MeshError, match="_init_backend=False"):
        DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("a", "b"),
                   _init_backend=False, _rank=1)["b"].get_group()


def _from_group_job() -> dict:
    from torch.distributed import device_mesh as torch_mesh

    ours = sw.init_device_mesh("cpu", (2,))
    again = DeviceMesh.from_group(ours.get_group(), "cpu")
    theirs = torch_mesh.init_device_mesh("cpu", (2,))
    return {"equal": ours == again, "names": ours._dim_group_names == again._dim_group_names,
            "coords": (ours._coordinate_on_dim, again._coordinate_on_dim,
                       theirs._coordinate_on_dim)}


def test_coordinate_on_dim_of_a_mesh_from_the_global_group_as_torchs() -> None:
    for rank, out in enumerate(run_in_processes(_from_group_job, 2, timeout=120)):
        assert out["equal"] and out["names"], out
        assert out["coords"] == ((rank,),) * 3, out
