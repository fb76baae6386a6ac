"""The load generator: ``flotilla bench load`` runs devices against a real server on either
edge, prints one JSON object, and checks that every accepted update was committed once.

The soak and the throughput figures live in ``benchmarks/load.py``; here a short run on
each edge shows the mechanism works and that its book-keeping catches what it claims to.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from flotilla.loadgen.device import Accepted
from flotilla.loadgen.latency import LatencyHistogram
from flotilla.loadgen.operator import CommittedRound, gauge
from flotilla.loadgen.run import LoadPlan, check_books
from tests.support.databases import POSTGRES_URL, deployment_database, empty_database
from tests.support.lifetime import bound

RUN_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_load_runs_http_devices_and_every_accepted_update_commits_once(
    tmp_path: object,
) -> None:
    """The HTTP edge here, on the deployment database; docs/load.md runs the gRPC edge."""
    edge = "http"
    argv = [sys.executable, "-m", "flotilla", "bench", "load", "--devices", "16",
            "--duration", "8", "--edge", edge, "--poll-hold", "2", "--json",
            "--workdir", str(tmp_path)]  # fmt: skip
    if deployment_database() == "postgresql":
        assert POSTGRES_URL is not None
        empty_database(POSTGRES_URL)
        argv += ["--db", POSTGRES_URL]
    done = subprocess.run(bound(argv), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object on stdout

    assert result["edge"] == edge
    assert result["enrolled"] == 16 and result["stuck_devices"] == 0
    assert result["rounds_committed"] >= 2, result
    assert result["accepted_updates"] > 0
    assert result["lost_updates"] == 0 and result["duplicated_updates"] == 0
    # Every update a device sent was taken: no refusals on a healthy run.
    assert result["not_accepted"] == 0
    latency = result["latency_ms"]
    for call in ("enrol", "poll", "fetch", "upload"):
        assert latency[call]["count"] > 0 and 0 < latency[call]["p50"] <= latency[call]["p99"]
    assert latency["upload"]["count"] == result["accepted_updates"]
    server = result["server"]
    assert server["rss_mib"]["end"] > 0 and server["fds"]["max"] > 0
    assert server["event_loop_tasks"]["max"] is not None


def test_latency_quantiles_are_within_two_percent_and_merge_across_workers() -> None:
    rng = random.Random(3)
    samples = [rng.lognormvariate(-4.0, 1.0) for _ in range(5_000)]
    a, b = LatencyHistogram(), LatencyHistogram()
    for i, s in enumerate(samples):
        (a if i % 2 else b).add(s)
    a.merge(LatencyHistogram.from_json(json.loads(json.dumps(b.to_json()))))
    assert a.total == len(samples)
    ordered = sorted(samples)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        assert exact <= a.quantile_s(q) <= exact * 1.0201
    assert LatencyHistogram().quantile_s(0.99) == 0.0


def test_the_books_find_lost_duplicated_and_uncommitted_updates() -> None:
    rounds = [
        CommittedRound("j", 1, ("d1", "d2"), 0.0, 1.0),
        CommittedRound("j", 2, ("d1", "d1"), 1.0, 2.0),  # a participant listed twice
    ]
    accepted = [
        Accepted("j", 1, "d1"),
        Accepted("j", 1, "d3"),  # accepted, but round 1 committed without it: lost
        Accepted("j", 2, "d2"),  # lost too
        Accepted("j", 2, "d1"),
        Accepted("j", 2, "d1"),  # the device saw it accepted twice
        Accepted("j", 3, "d2"),  # round 3 never committed
    ]
    assert check_books(accepted, rounds) == {
        "lost_updates": 2,
        "duplicated_updates": 2,
        "uncommitted_at_end": 1,
    }
    assert check_books([Accepted("j", 1, "d2")], rounds)["lost_updates"] == 0


def test_a_plan_never_asks_more_devices_a_round_than_exist_and_refuses_nonsense() -> None:
    assert LoadPlan(devices=20, duration_s=1, jobs=2, clients_per_round=50).per_round == 10
    assert LoadPlan(devices=1000, duration_s=1, jobs=2, clients_per_round=50).per_round == 50
    with pytest.raises(Exception, match="edge"):
        LoadPlan(devices=1, duration_s=1, edge="carrier-pigeon")
    with pytest.raises(Exception, match=">= 1"):
        LoadPlan(devices=0, duration_s=1)
    with pytest.raises(Exception, match="grpc edge"):
        LoadPlan(devices=1, duration_s=1, servers=2, edge="http")


def test_gauge_reads_an_unlabelled_sample_from_the_exposition() -> None:
    text = '# HELP x y\nflotilla_event_loop_tasks 42.0\nother{a="b"} 1\n'
    assert gauge(text, "flotilla_event_loop_tasks") == 42.0
    assert gauge(text, "missing") is None
