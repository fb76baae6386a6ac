"""``/metrics``'s body on a real federation: real agents train digits in this process while a
hand-driven device sends what a broken or late client sends; the exposition parses as
Prometheus text and its numbers agree with what the store recorded."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import StaleRoundError, UpdateRejected, WireError
from flotilla.core.events import DeviceChanged, Event
from flotilla.core.records import DeviceFailure, RoundRecord
from flotilla.core.work import RoundRef
from flotilla.server.app import FederationServer, ServerConfig
from flotilla.server.federation import auth
from flotilla.server.metrics import PrometheusMetrics
from tests.support.hand_device import HandDevice, delta
from tests.support.inproc import DIGITS, in_process_federation, poll_until

pytestmark = pytest.mark.timeout(300)


def scrape(metrics: PrometheusMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, parsed back as Prometheus reads it."""
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain; version=")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            assert isinstance(sample, Sample)
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:  # fmt: skip
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_counters_follow_rounds_refusals_bytes_and_devices(
    db_url: str, digits_spec: Path, tmp_path: Path
) -> None:
    metrics = PrometheusMetrics()
    async with in_process_federation(tmp_path / "state", db_url, sinks=(metrics,)) as fed:
        metrics.watch_devices(fed.federation.device_counts)
        empty = scrape(metrics)
        assert value(empty, "flotilla_devices", state="idle") == 0.0
        assert value(empty, "flotilla_bytes_received_total") == 0.0

        hand = await HandDevice.enrol(fed)
        assert await fed.federation.poll(hand.record, hand.profile) is None  # online, idle
        await fed.start_agents(2)
        await fed.wait_devices(3, timeout=60)
        assert value(scrape(metrics), "flotilla_devices", state="idle") == 3.0
        job_id = await fed.submit(
            digits_spec,
            "job.rounds=2",
            "job.clients_per_round=3",
            "job.min_quorum=2",
            "job.name=metrics",
        )
        task = await hand.task_of(job_id, timeout_s=60)
        assert await hand.download(task) == task.order.model_size
        ref = RoundRef(task.order.job_id, task.order.round, task.order.round_token)
        with pytest.raises(WireError, match="exceeds the limit"):
            await fed.federation.reserve_upload(hand.record, ref, 1 << 40)
        with pytest.raises(UpdateRejected, match="shape"):
            await hand.upload(task, delta(task, grow_last=True))
        with pytest.raises(UpdateRejected, match="NaN or Inf"):
            await hand.upload(task, delta(task, fill=float("nan")))
        # It gives up on the round instead of sending a good update: a failure, "left".
        fed.federation.leave(hand.record, "switched off")

        async def first_round() -> bool:
            job = await fed.store.get_job(job_id)
            return job is not None and job.rounds_committed >= 1

        assert await poll_until(first_round, 120)
        with pytest.raises(StaleRoundError):
            await hand.upload(task, delta(task))  # the round has moved on
        status = await fed.wait_for(job_id, timeout=180)
        assert status["state"] == "completed", status
        await fed.wait_devices(2, timeout=60)
        rounds = await fed.store.list_rounds(job_id)
        exported = len(await fed.export(job_id))
        samples = scrape(metrics)

    assert value(samples, "flotilla_rounds_committed_total", job=job_id) == 2.0
    for reason in ("shape", "non_finite", "stale", "oversized"):
        got = value(samples, "flotilla_updates_refused_total", job=job_id, reason=reason)
        assert got == 1.0, (reason, got)
    accepted = sum(len(r.participants) for r in rounds)
    assert accepted == 4  # two agents, two rounds
    assert value(samples, "flotilla_updates_accepted_total", job=job_id) == accepted
    assert value(samples, "flotilla_device_failures_total", job=job_id, reason="left") == 1.0
    assert fed.federation.device_failures() == {hand.record.id: {"left": 1}}

    # Bytes: what the counters saw is what the rounds' accounts recorded.
    bytes_up = sum(r.account.bytes_up for r in rounds)
    bytes_down = sum(r.account.bytes_down for r in rounds)
    assert bytes_up > 0 and bytes_down > 0
    assert value(samples, "flotilla_bytes_received_total") == bytes_up
    # Downloads: the agents' (in the accounts), the hand device's, and the export.
    sent = value(samples, "flotilla_bytes_sent_total")
    assert sent == bytes_down + task.order.model_size + exported

    for name in (
        "flotilla_round_duration_seconds",
        "flotilla_aggregation_seconds",
        "flotilla_db_commit_seconds",
    ):
        assert value(samples, f"{name}_count") == 2.0, name
        assert value(samples, f"{name}_bucket", le="+Inf") == 2.0, name
    assert value(samples, "flotilla_poll_latency_seconds_count") > 0
    assert value(samples, "flotilla_job_transitions_total", state="completed") == 1.0
    devices = {s: value(samples, "flotilla_devices", state=s) for s in ("idle", "busy", "offline")}
    assert devices == {"idle": 2.0, "busy": 0.0, "offline": 1.0}

    first, second = rounds
    check_accounts(first, second, hand.record.id)


def check_accounts(first: RoundRecord, second: RoundRecord, hand_id: str) -> None:
    """Round 1 chose all three devices and the hand device left it; round 2 had the two
    agents only."""
    agents = {p.device_id for p in first.participants}
    assert set(first.account.selected) == agents | {hand_id}
    assert first.account.failures == (DeviceFailure(hand_id, "left"),)
    assert first.account.stale == ()
    assert first.account.decisions[0] == "selected 3 of 3 idle by greedy"
    assert "closed once no device owed an update: 2 of 3 (quorum 2)" in first.account.decisions
    assert set(second.account.selected) == agents
    assert second.account.failures == ()
    assert second.account.decisions[0] == "selected 2 of 2 idle by greedy"
    for r in (first, second):
        assert r.account.bytes_up == sum(p.metrics["bytes_up"] for p in r.participants)


def test_every_metric_is_exposed_before_anything_happens() -> None:
    """A fresh server's scrape names every histogram and the gauge (dashboards can be built
    before the first round), and two servers in one process keep separate numbers."""
    a, b = PrometheusMetrics(), PrometheusMetrics(lambda: {"idle": 4})
    names = {f.name for f in text_string_to_metric_families(a.exposition()[0].decode())}
    assert {
        "flotilla_bytes_received",
        "flotilla_bytes_sent",
        "flotilla_round_duration_seconds",
        "flotilla_aggregation_seconds",
        "flotilla_poll_latency_seconds",
        "flotilla_db_commit_seconds",
        "flotilla_devices",
    } <= names
    samples = scrape(b)
    assert value(samples, "flotilla_devices", state="idle") == 4.0
    assert value(samples, "flotilla_devices", state="offline") == 0.0
    assert value(scrape(a), "flotilla_devices", state="idle") == 0.0


def test_the_docs_and_the_grafana_dashboard_name_only_real_metrics() -> None:
    """Every ``flotilla_*`` series docs/metrics.md or the Grafana dashboard mentions is one
    the server exposes, and every metric the server exposes is documented."""
    exposed: set[str] = set()  # every series name a scrape can hold
    documented: set[str] = set()  # how the page's table names each metric
    families = text_string_to_metric_families(PrometheusMetrics().exposition()[0].decode())
    for family in families:
        if family.name.endswith("_created"):
            continue  # prometheus_client's start time of each counter and histogram
        if family.type == "histogram":
            exposed |= {family.name + s for s in ("", "_bucket", "_sum", "_count")}
            documented.add(family.name)
        else:
            name = family.name + ("_total" if family.type == "counter" else "")
            exposed.add(name)
            documented.add(name)
    docs = Path(__file__).resolve().parent.parent / "docs"
    page = (docs / "metrics.md").read_text()
    dashboard = (docs / "grafana-dashboard.json").read_text()
    json.loads(dashboard)
    for text in (page, dashboard):
        mentioned = set(re.findall(r"\bflotilla_[a-z_]+", text))
        assert mentioned and mentioned <= exposed, sorted(mentioned - exposed)
    ours = {name for name in documented if name.startswith("flotilla_")}
    assert set(re.findall(r"^\| `(flotilla_[a-z_]+)`", page, re.MULTILINE)) == ours
    # The process collector's series (prometheus-client's) share one row of the table.
    assert {"process_resident_memory_bytes", "process_open_fds"} <= documented
    assert "`process_resident_memory_bytes`, `process_open_fds`" in page


async def test_the_server_wires_its_metrics_and_the_sinks_it_was_given(tmp_path: Path) -> None:
    """``FederationServer`` sends the federation's events to its ``metrics`` and to every
    sink added before ``start`` (the HTTP edge adds its live feed there)."""
    heard: list[Event] = []

    class Listener:
        def emit(self, event: Event) -> None:
            heard.append(event)

    server = FederationServer(ServerConfig(state_dir=tmp_path / "state", http_port=None))
    server.add_sink(Listener())
    await server.start()
    try:
        with pytest.raises(RuntimeError, match="before start"):
            server.add_sink(Listener())
        token = auth.new_secret()
        await server.store.add_enrol_token(auth.hash_secret(token))
        credential = await server.federation.enrol(token, DeviceProfile("", tasks=(DIGITS,)))
        samples = scrape(server.metrics)
    finally:
        await server.stop(grace_s=0)
    assert heard == [DeviceChanged(credential.device_id, "enrolled")]
    assert value(samples, "flotilla_devices", state="offline") == 1.0  # enrolled, not seen


async def test_a_device_cannot_mint_job_labels(db_url: str, tmp_path: Path) -> None:
    """Refusals naming a job that never ran are counted against no job: label values stay
    bounded by what the operator submitted, whatever devices send."""
    metrics = PrometheusMetrics()
    async with in_process_federation(tmp_path / "state", db_url, sinks=(metrics,)) as fed:
        hand = await HandDevice.enrol(fed)
        for n in range(3):
            with pytest.raises(StaleRoundError):
                await fed.federation.reserve_upload(hand.record, RoundRef(f"job-{n}", 1, "t"), 9)
        samples = scrape(metrics)
    assert value(samples, "flotilla_updates_refused_total", job="", reason="stale") == 3.0
    assert not [k for k in samples if dict(k[1]).get("job", "").startswith("job-")]
