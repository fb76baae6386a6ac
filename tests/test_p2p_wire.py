"""Flotilla's averagers speak hivemind's own protocol: every RPC handler answers under the
name hivemind gives it, so plain hivemind peers and flotilla peers reach each other."""

from __future__ import annotations

import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from flotilla.p2p.averaging import (
    AgreedAverager,
    PlainGradientAverager,
    PlainStateAverager,
    SafeAverager,
    SafeGradientAverager,
    SafeStateAverager,
)

SHIPPED = [
    (PlainGradientAverager, GradientAverager),
    (SafeGradientAverager, GradientAverager),
    (PlainStateAverager, TrainingStateAverager),
    (SafeStateAverager, TrainingStateAverager),
    (SafeAverager, DecentralizedAverager),
    (AgreedAverager, DecentralizedAverager),
]


@pytest.mark.parametrize(("ours", "theirs"), SHIPPED, ids=[o.__name__ for o, _ in SHIPPED])
@pytest.mark.parametrize("namespace", ["run_grad_averager", None])
def test_every_handler_answers_under_hivemind_s_own_name(
    ours: type, theirs: type, namespace: str | None
) -> None:
    ours._collect_rpc_handlers()  # type: ignore[attr-defined]
    theirs._collect_rpc_handlers()  # type: ignore[attr-defined]
    methods = {h.method_name for h in theirs._rpc_handlers}  # type: ignore[attr-defined]
    assert methods >= {"rpc_join_group", "rpc_aggregate_part", "rpc_download_state"}
    assert methods <= {h.method_name for h in ours._rpc_handlers}  # type: ignore[attr-defined]
    for method in methods:
        want = theirs._get_handle_name(namespace, method)  # type: ignore[attr-defined]
        assert ours._get_handle_name(namespace, method) == want  # type: ignore[attr-defined]
        assert want.endswith(f"{theirs.__name__}.{method}")
