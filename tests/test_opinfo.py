"""Every OpInfo of the installed torch's ``op_db`` on DTensors, against single-device torch.

Sample inputs are distributed on meshes (2,), (3,) (uneven) and (2, 2) with several placements
per tensor, run forward and (on one mesh per sample) backward; the strategies of every aten op
the samples reach are then forced one by one (``shardwise.rules.validate_strategy``). Sampled for CI
(the first sample, two placement variants per mesh, two strategies per mesh);
``SHARDWISE_OPINFO_FULL=1`` runs eight samples and more variants, ``SHARDWISE_VALIDATE_ALL=1``
every strategy. ``python tests/opinfo_sweep.py`` prints the counts.
"""

from __future__ import annotations

import pytest

from opinfo_sweep import PASS, SKIP, WRONG, op_db, op_id, run_opinfo, validate_new
from opinfo_xfail import XFAIL

OPINFOS = op_db()
_VALIDATED: set = set()  # ops whose strategies an earlier OpInfo already forced


@pytest.mark.parametrize("opinfo", OPINFOS, ids=[op_id(o) for o in OPINFOS])
def test_opinfo(opinfo) -> None:
    calls: dict = {}
    outcome = run_opinfo(opinfo, calls=calls)
    wrong_strategies = validate_new(calls, _VALIDATED)
    assert not wrong_strategies, "\n".join(wrong_strategies[:20])
    assert outcome.status != WRONG, outcome.message
    if outcome.status == SKIP:
        pytest.skip(outcome.message)
    if outcome.name in XFAIL:
        assert outcome.status != PASS, (
            f"{outcome.name} passes now: remove it from tests/opinfo_xfail.py"
        )
        pytest.xfail(XFAIL[outcome.name])
    assert outcome.status == PASS, outcome.message


def test_expected_failures_name_existing_opinfos() -> None:
    names = {op_id(o) for o in OPINFOS}
    assert not set(XFAIL) - names
