"""A round's account (selected, failures, stale arrivals, bytes, decisions) survives the
store on every database and lands in a simulation's ``metrics.jsonl``, where ``flotilla
dashboard DIR`` reads it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flotilla.core.events import FAILURE_REASONS
from flotilla.core.records import DeviceFailure, RoundAccount
from flotilla.server.federation.store import Store
from flotilla.simulation.experiment import load_experiment
from flotilla.simulation.runner import run_experiment
from tests.support.experiments import experiment_file, rows
from tests.test_store import make_commit, make_job, sha

ACCOUNT = RoundAccount(
    selected=("dev-a", "dev-b", "dev-c", "dev-d"),
    failures=(DeviceFailure("dev-c", "left"),),
    stale=("dev-d",),
    bytes_up=123_456_789_012,  # beyond 32 bits
    bytes_down=42,
    decisions=("selected 4 of 9 idle by oort", "waited 2.0 s for devices"),
)


async def test_a_rounds_account_reads_back_as_committed(store: Store) -> None:
    await store.add_job(make_job(rounds_total=2))
    await store.add_checkpoint(sha(0), 1)
    await store.commit_round(dataclasses.replace(make_commit(rnd=1), account=ACCOUNT))
    await store.commit_round(make_commit(rnd=2))  # a round that recorded nothing more
    first, second = await store.list_rounds("job-1")
    assert first.account == ACCOUNT
    assert second.account == RoundAccount()


def test_an_account_survives_json_and_an_old_row_reads_empty() -> None:
    assert RoundAccount.from_json(ACCOUNT.to_json()) == ACCOUNT
    assert RoundAccount.from_json(None) == RoundAccount.from_json({}) == RoundAccount()
    assert RoundAccount.from_json({"bytes_up": 7}) == RoundAccount(bytes_up=7)


def test_a_simulations_metrics_rows_carry_each_rounds_account(tmp_path: Path) -> None:
    """60 devices, 12 selected for 10 updates: every selected device is a participant, a
    failure (with its reason) or a stale arrival, and the bytes match."""
    out = tmp_path / "out"
    run_experiment(load_experiment(experiment_file(tmp_path)), out, progress=False)
    metrics = rows(out)
    assert [r["round"] for r in metrics] == [1, 2, 3, 4]
    by_round: dict[int, list[dict[str, object]]] = {}
    for p in rows(out, "participation.jsonl"):
        by_round.setdefault(int(p["round"]), []).append(p)
    for r in metrics:
        participants = {str(p["device"]) for p in by_round[r["round"]]}
        failed = {f["device_id"] for f in r["failures"]}
        assert {f["reason"] for f in r["failures"]} <= set(FAILURE_REASONS)
        assert len(r["selected"]) == 12
        assert set(r["selected"]) == participants | failed | set(r["stale"])
        assert not participants & (failed | set(r["stale"]))
        assert r["bytes_up"] == sum(p["bytes_up"] for p in by_round[r["round"]]) > 0
        assert r["bytes_down"] == sum(p["bytes_down"] for p in by_round[r["round"]])
        assert r["decisions"][0].startswith("selected 12 of ")
    # Over-selection: the round closes with 10 updates, the 2 still out were cut off.
    assert all(len(r["failures"]) + len(r["stale"]) == 2 for r in metrics)
    assert any(f["reason"] == "cut_off" for r in metrics for f in r["failures"])
