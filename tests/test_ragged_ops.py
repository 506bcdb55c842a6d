"""RaggedShard through op rules: the op oracle (single-device PyTorch, values and gradients)
over placement cases that hold at least one RaggedShard, and the placements the rules carry."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import check_op, placement_cases
from shardwise import Partial, RaggedShard, Replicate

MESHES = [(3,), (4,), (2, 2)]


def _ragged_cases(mesh_shape, tensors, count=10):
    """Placement cases (one per input) with a RaggedShard somewhere, a seeded sample."""
    cases = placement_cases(mesh_shape, tensors, ragged=True, max_cases=10**6)
    ragged = [c for c in cases if any(isinstance(p, RaggedShard) for ps in c for p in ps)]
    return random.Random(5).sample(ragged, min(count, len(ragged)))


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _embedding_bag(w: torch.Tensor) -> torch.Tensor:
    with sw.config.implicit_replication():  # plain indices and offsets every rank holds whole
        return F.embedding_bag(torch.tensor([1, 0, 4, 4, 2]), w, torch.tensor([0, 2]),
                               mode="max")


OPS = {
    "add": (lambda a, b: a + b, [_x(6, 5), _x(6, 5, seed=1)]),
    "mul_broadcast": (lambda a, b: a * b, [_x(6, 5), _x(5, seed=1)]),
    "gelu": (F.gelu, [_x(7, 4)]),
    "where": (lambda a, b: torch.where(a > 0, a, b), [_x(6, 5), _x(6, 5, seed=1)]),
    "sum_0": (lambda a: a.sum(0), [_x(7, 4)]),
    "sum_1": (lambda a: a.sum(1), [_x(7, 4)]),
    "mean": (lambda a: a.mean(), [_x(7, 4)]),
    "amax_1": (lambda a: a.amax(1), [_x(7, 4)]),
    "softmax": (lambda a: a.softmax(-1), [_x(6, 5)]),
    "transpose": (lambda a: a.transpose(0, 1) * 2, [_x(7, 4)]),
    "unsqueeze": (lambda a: a.unsqueeze(1) + 1, [_x(7, 4)]),
    "view_keep_rows": (lambda a: a.view(6, 8), [_x(6, 4, 2)]),
    "view_split_rows": (lambda a: a.reshape(3, 2, 5), [_x(6, 5)]),
    "matmul": (lambda a, b: a @ b, [_x(7, 4), _x(4, 3, seed=1)]),
    "linear": (lambda a, w: F.linear(a, w), [_x(2, 7, 4), _x(3, 4, seed=1)]),
    "bmm": (torch.bmm, [_x(5, 3, 4), _x(5, 4, 2, seed=1)]),
    "pad": (lambda a: F.pad(a, (1, 2)), [_x(7, 4)]),
    "reflect_pad": (lambda a: F.pad(a.unsqueeze(0), (2, 1), mode="reflect"), [_x(7, 4)]),
    "cdist": (torch.cdist, [_x(7, 3), _x(5, 3, seed=1)]),
    "embedding_bag": (_embedding_bag, [_x(5, 7)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_ragged_inputs_match_pytorch(name) -> None:
    fn, tensors = OPS[name]
    for mesh_shape in MESHES:
        for case in _ragged_cases(mesh_shape, tensors):
            check_op(fn, tensors, mesh_shape, case)


# ----- what the rules carry (no communication) -------------------------------------------------


def _mesh():
    return sw.init_device_mesh("cpu", (4,))


ROWS = RaggedShard(0, (3, 0, 5, 2))


def _rows(x):
    return sw.distribute_tensor(x, _mesh(), [ROWS])


def _no_comm(fn, *args):
    with sw.debug.CommCounter() as counter:
        out = fn(*args)
    assert counter.total_bytes == 0, counter
    return out


def test_pointwise_keeps_equal_ragged_operands() -> None:
    x, y = _x(10, 3), _x(10, 3, seed=1)
    out = _no_comm(lambda a, b: a * b + 1, _rows(x), _rows(y))
    assert out.placements == (ROWS,)
    torch.testing.assert_close(out.full_tensor(), x * y + 1)


def test_pointwise_with_different_sizes_moves_one_operand() -> None:
    x, y = _x(10, 3), _x(10, 3, seed=1)
    other = sw.distribute_tensor(y, _mesh(), [RaggedShard(0, (1, 2, 3, 4))])
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        _rows(x) + other
    with sw.config.allow_implicit_redistribute():
        out = _rows(x) + other
    torch.testing.assert_close(out.full_tensor(), x + y)


def test_reductions_over_and_beside_the_ragged_dim() -> None:
    x = _x(10, 3)
    over = _no_comm(lambda a: a.sum(0), _rows(x))
    assert over.placements == (Partial(),)
    torch.testing.assert_close(over.full_tensor(), x.sum(0))
    beside = _no_comm(lambda a: a.sum(1), _rows(x))
    assert beside.placements == (ROWS,)
    torch.testing.assert_close(beside.full_tensor(), x.sum(1))


def test_views_that_keep_the_dim_carry_it() -> None:
    x = _x(10, 3)
    t = _no_comm(lambda a: a.t(), _rows(x))
    assert t.placements == (RaggedShard(1, ROWS.sizes),)
    torch.testing.assert_close(t.full_tensor(), x.t())
    u = _no_comm(lambda a: a.unsqueeze(0), _rows(x))
    assert u.placements == (RaggedShard(1, ROWS.sizes),)
    y = _x(10, 3, 2)
    v = _no_comm(lambda a: a.view(10, 6), _rows(y))
    assert v.placements == (ROWS,)
    torch.testing.assert_close(v.full_tensor(), y.view(10, 6))


def test_matmul_on_the_other_dims_keeps_ragged_rows() -> None:
    x, w = _x(10, 3), _x(3, 4, seed=1)
    dw = sw.distribute_tensor(w, _mesh(), [Replicate()])
    out = _no_comm(lambda a, b: a @ b, _rows(x), dw)
    assert out.placements == (ROWS,)
    torch.testing.assert_close(out.full_tensor(), x @ w)
    # ragged contraction dims with equal sizes: Partial, as for even shards
    xc = sw.distribute_tensor(x.t().contiguous(), _mesh(), [RaggedShard(1, ROWS.sizes)])
    pc = _no_comm(lambda a, b: a @ b, xc, _rows(_x(10, 2, seed=2)))
    assert pc.placements == (Partial(),)
    torch.testing.assert_close(pc.full_tensor(), x.t() @ _x(10, 2, seed=2))


def test_views_merging_the_ragged_dim() -> None:
    """Merging a ragged outer dim stays local (sizes scaled); merging a ragged inner dim
    cannot: explicit mode names the move, implicit mode makes it."""
    x = _x(10, 3)
    flat = _no_comm(lambda a: a.reshape(30), _rows(x))
    assert flat.placements == (RaggedShard(0, (9, 0, 15, 6)),)
    torch.testing.assert_close(flat.full_tensor(), x.reshape(30))
    cols = sw.distribute_tensor(x.t().contiguous(), _mesh(), [RaggedShard(1, ROWS.sizes)])
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        cols.reshape(30)
    with sw.config.allow_implicit_redistribute():
        out = cols.reshape(30)
    torch.testing.assert_close(out.full_tensor(), x.t().reshape(30))
