"""glu, rot90, cross, prelu, renorm, vdot / addr / addbmm, the norm overloads, special
functions, complex views and whole-tensor ops (pdist, ctc_loss, binary cross entropy) on
DTensors against single-device torch, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


CASES = [
    ("glu", lambda x: F.glu(x, dim=1), [(3, 4, 5)]),
    ("rot90", lambda x: torch.rot90(x, 1, (1, 2)), [(3, 4, 5)]),
    ("cross", lambda a, b: torch.linalg.cross(a, b, dim=1), [(4, 3, 2), (4, 3, 2)]),
    ("cross_broadcast", lambda a, b: torch.linalg.cross(a, b), [(5, 3), (1, 3)]),
    ("prelu", lambda x, w: F.prelu(x, w), [(3, 4, 5), (4,)]),
    ("renorm", lambda x: torch.renorm(x, 2, 0, 1.0), [(4, 3, 5)]),
    ("vdot", torch.vdot, [(7,), (7,)]),
    ("addr", lambda s, a, b: torch.addr(s, a, b, beta=0.5), [(4, 5), (4,), (5,)]),
    ("addbmm", torch.addbmm, [(3, 5), (4, 3, 2), (4, 2, 5)]),
    ("norm", lambda x: torch.norm(x, p=3, dim=1), [(4, 5)]),
    ("pairwise_distance", F.pairwise_distance, [(5, 4), (5, 4)]),
    ("special_bessel_j0", torch.special.bessel_j0, [(4, 5)]),
    ("special_entr", lambda x: torch.special.entr(x.abs()), [(4, 5)]),
    ("polar", lambda a, b: torch.view_as_real(torch.polar(a.abs(), b)), [(4, 5), (4, 5)]),
    ("complex_conj", lambda a, b: torch.view_as_real(torch.complex(a, b).conj() * 2),
     [(4, 5), (4, 5)]),
    ("view_as_complex", lambda x: torch.view_as_complex(x).abs(), [(4, 3, 2)]),
    ("pdist", F.pdist, [(5, 3)]),
    ("binary_cross_entropy", lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid()),
     [(4, 5), (4, 5)]),
]


@pytest.mark.parametrize("name,fn,shapes", CASES, ids=[c[0] for c in CASES])
def test_oracle(name, fn, shapes) -> None:
    tensors = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    assert run_oracle(fn, tensors, mesh_shapes=MESHES, max_cases=3) > 0


def test_special_zeta_oracle() -> None:  # no derivative in torch
    run_oracle(lambda x: torch.special.zeta(x.abs() + 1.5, 2.0), [randn(4, 5)],
               mesh_shapes=MESHES, max_cases=3, grad=False)


def test_ctc_loss_oracle() -> None:
    log_probs = randn(6, 3, 5).log_softmax(2)
    targets = torch.tensor([[1, 2], [3, 3], [4, 1]])
    def ctc(lp):  # plain targets every rank holds whole: taken as replicated
        with sw.config.implicit_replication():
            return F.ctc_loss(lp, targets, [6, 5, 6], [2, 2, 1])

    run_oracle(ctc, [log_probs], mesh_shapes=[(2,), (3,)], max_cases=3)
