"""Server-less federated rounds (``[aggregation] transport = "p2p"``).

The agreement logic driven in-process through the real Gateway; the all-reduce that makes
agreement possible on real hivemind peers; and a whole job: a real server, five real
agent processes averaging among themselves, one killed with kill -9 mid-round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flotilla.compression import apply_average
from flotilla.core.allreduce import Contribution, GroupPlan
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import SpecError, UpdateRejected, WireError
from flotilla.core.spec import JobSpec
from flotilla.core.tensors import TensorSpec, state_sha256
from flotilla.core.update import Update
from flotilla.core.work import WorkOrder
from flotilla.engine import Reported, TrainTask, validate_spec
from flotilla.engine.p2p_round import Agreement
from flotilla.engine.tally import RoundTally
from flotilla.scheduling import DevicePool, Leases
from flotilla.server.federation.gateway import Gateway
from tests.support.processes import AgentFleet, ServerProcess

# Hivemind swarms are timing-bound: the tests of one group run one at a time on one worker
# (volunteer runs in one group, server-coordinated and all-reduce rounds in the other).
pytestmark = pytest.mark.xdist_group("hivemind-rounds")

TASK = "pkg.mod:Task"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits.toml"


def _p2p_task() -> TrainTask:
    order = WorkOrder(
        job_id="job-1",
        round=1,
        round_token="tok-1",
        task=TASK,
        config_json="{}",
        model_sha256="ab" * 32,
        model_size=1,
        deadline=1e12,
        seed=1,
    )
    return TrainTask(order, layout=(TensorSpec("w", "F32", (2,)),), transport="p2p")


def _gateway() -> Gateway:
    clock = time.time
    pool = DevicePool(clock)
    for device_id in "abcd":
        pool.seen(DeviceProfile(device_id, tasks=(TASK,)))
    return Gateway(pool, clock, Leases(pool))


def _report(device: str, sha: str, members: str = "abc") -> Reported:
    group = tuple(Contribution(m, 10, {"train_loss": 0.5}) for m in members)
    return Reported(device, 0.0, sha, "group-1", group, allreduce_s=0.2)


def _upload(device: str, delta: np.ndarray) -> Update:
    return Update("job-1", 1, device, 10, {"w": delta.astype(np.float32)})


@pytest.mark.timeout(20)
async def test_quorum_of_reports_and_one_checked_upload_commit_the_agreed_model() -> None:
    gw = _gateway()
    base = {"w": np.array([1.0, 2.0], dtype=np.float32)}
    average = np.array([0.25, -0.5], dtype=np.float32)
    sha = state_sha256(apply_average(base, {"w": average}))
    task = _p2p_task()
    gw.pool.claim(list("abc"), task.order.job_id)
    stream = gw.dispatch(task, list("abc"))
    agreement = Agreement(base, quorum=2, selected=set("abc"))
    tally = RoundTally()
    collecting = asyncio.ensure_future(
        agreement.collect(stream, time.time() + 30, time.time, tally)
    )
    rnd = gw.expect("a", task.order.job_id, task.order.round, task.order.round_token)

    assert gw.report(rnd, _report("a", sha)) is True  # the first reporter is asked to upload
    assert gw.report(rnd, _report("b", sha)) is False
    with pytest.raises(WireError, match="upload only when asked"):
        gw.expect_upload(rnd, "b")
    with pytest.raises(UpdateRejected, match="one model per round"):
        gw.report(rnd, _report("b", "cd" * 32))

    # b's report is held, not answered "no" over and over: an average that does not
    # rebuild the reported model is refused, and the held reporter is asked at once.
    held = asyncio.ensure_future(gw.hold_reporter(rnd, "b", 10.0))
    await asyncio.sleep(0.05)
    assert not held.done()
    gw.expect_upload(rnd, "a")
    with pytest.raises(UpdateRejected, match="rebuilds model"):
        await gw.deliver(rnd, _upload("a", average + 1e-3), 5.0)
    assert await asyncio.wait_for(held, 2.0) is True
    assert gw.report(rnd, _report("b", sha)) is True
    gw.expect_upload(rnd, "b")
    await gw.deliver(rnd, _upload("b", average), 5.0)

    agreed = await asyncio.wait_for(collecting, 5.0)
    assert agreed is not None and agreed.sha256 == sha
    assert state_sha256(agreed.model) == sha
    assert {r.device_id for r in agreed.supporters} == {"a", "b"}
    assert gw.report(rnd, _report("c", sha)) is False  # taken: nobody else uploads
    held = asyncio.ensure_future(gw.hold_reporter(rnd, "c", 10.0))
    await stream.aclose()  # type: ignore[attr-defined]  # the round closes: c goes free
    assert await asyncio.wait_for(held, 2.0) is False
    assert not gw.round_open(task.order.round_token)
    records = agreement.participation(agreed, "job-1", 1, time.time())
    assert sorted(r.device_id for r in records) == ["a", "b", "c"]
    assert all(r.num_samples == 10 and r.metrics == {"train_loss": 0.5} for r in records)


@pytest.mark.timeout(20)
async def test_reports_that_name_strangers_or_disagree_do_not_commit() -> None:
    gw = _gateway()
    base = {"w": np.zeros(2, dtype=np.float32)}
    task = _p2p_task()
    gw.pool.claim(list("abc"), task.order.job_id)
    stream = gw.dispatch(task, list("abc"))
    agreement = Agreement(base, quorum=2, selected=set("abc"))
    tally = RoundTally()
    rnd = gw.expect("a", task.order.job_id, task.order.round, task.order.round_token)
    one = state_sha256(apply_average(base, {"w": np.ones(2, dtype=np.float32)}))
    other = state_sha256(apply_average(base, {"w": -np.ones(2, dtype=np.float32)}))
    gw.report(rnd, _report("a", one, members="abd"))  # d was not selected
    gw.report(rnd, _report("b", one, members="ac"))  # b does not name itself
    gw.report(rnd, _report("c", other))
    collected = await agreement.collect(stream, time.time() + 1.0, time.time, tally)
    assert collected is None
    assert sorted(tally.failures) == ["a", "b"]
    assert list(agreement.reports) == ["c"]
    await stream.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["aggregation.transport=carrier-pigeon"], "transport"),
        (["aggregation.transport=p2p", "aggregation.strategy=krum"], "strategy must be"),
        (["aggregation.transport=p2p", "compression.uplink=topk"], "compression.uplink"),
        (["aggregation.transport=p2p", "compression.downlink=int8"], "exact model"),
        (["aggregation.transport=p2p", "aggregation.matchmaking_s=90"], "shorter than"),
    ],
)
def test_p2p_specs_that_cannot_work_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec(JobSpec.load(EXAMPLE, overrides))


def test_p2p_spec_with_int8_on_the_wire_is_accepted() -> None:
    spec = JobSpec.load(EXAMPLE, ["aggregation.transport=p2p", "compression.uplink=int8"])
    validate_spec(spec)
    assert spec.aggregation.transport == "p2p"


@pytest.mark.timeout(120)
def test_group_members_end_with_identical_bits_under_int8() -> None:
    """hivemind's own all-reduce leaves members a quantization step apart; ours must not."""
    from flotilla.p2p import UpdateAverager, start_dht
    from flotilla.p2p.dht import visible_maddrs

    rendezvous = start_dht()
    peers = tuple(visible_maddrs(rendezvous))
    plan = GroupPlan(peers, group_size=3, min_group_size=3, matchmaking_s=10.0, compression="int8")
    rng = np.random.default_rng(0)
    deltas = [{"w": rng.standard_normal((200, 150)).astype(np.float32)} for _ in range(3)]
    averagers = [UpdateAverager() for _ in range(3)]
    results: dict[int, object] = {}

    def member(i: int) -> None:
        me = Contribution(f"dev-{i}", 10 * (i + 1))
        try:
            results[i] = averagers[i].average("group-test", plan, deltas[i], me, 60.0)
        except Exception as exc:  # recorded, so the assertion shows it
            results[i] = exc

    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        for a in averagers:
            a.shutdown()
        rendezvous.shutdown()
    outs = [results[i] for i in range(3)]
    assert all(not isinstance(o, Exception) for o in outs), outs
    digests = {hashlib.sha256(o.delta["w"].tobytes()).hexdigest() for o in outs}  # type: ignore[attr-defined]
    assert len(digests) == 1, "members must hold identical averages"
    exact = sum(10 * (i + 1) * deltas[i]["w"] for i in range(3)) / 60
    got = outs[0].delta["w"]  # type: ignore[attr-defined]
    assert np.abs(got - exact).max() < 0.05  # int8 on the wire, twice
    names = [c.device_id for c in outs[0].contributors]  # type: ignore[attr-defined]
    assert names == ["dev-0", "dev-1", "dev-2"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_peer_the_server_did_not_name_cannot_join_the_group(tmp_path: Path) -> None:
    """The plan names each selected device's peer id; a peer holding the group key but not
    named (a device that passed its round token on) contributes nothing."""
    from flotilla.client.peer_id import ensure_identity
    from flotilla.core.allreduce import PeerOptions
    from flotilla.p2p import UpdateAverager, start_dht
    from flotilla.p2p.dht import visible_maddrs

    rendezvous = start_dht()
    keys = [tmp_path / f"peer{i}.key" for i in range(4)]
    members = {ensure_identity(keys[i]): f"dev-{i}" for i in range(3)}
    ensure_identity(keys[3])
    plan = GroupPlan(tuple(visible_maddrs(rendezvous)), 3, 3, matchmaking_s=8.0, members=members)
    deltas = [{"w": np.full(1000, float(i), dtype=np.float32)} for i in range(4)]
    averagers = [UpdateAverager(PeerOptions(identity_path=k)) for k in keys]
    results: dict[int, object] = {}

    def peer(i: int) -> None:
        try:
            me = Contribution(f"dev-{i}", 10)
            wait = 20.0 if i == 3 else 45.0
            results[i] = averagers[i].average("group-key", plan, deltas[i], me, wait)
        except Exception as exc:  # recorded, so the assertion shows it
            results[i] = exc

    stranger = threading.Thread(target=peer, args=(3,))
    stranger.start()  # first in, so it is there when the members look for a group
    time.sleep(1.0)
    threads = [threading.Thread(target=peer, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in [*threads, stranger]:
            t.join(100)
    finally:
        for a in averagers:
            a.shutdown()
        rendezvous.shutdown()
    for i in range(3):
        out = results[i]
        assert not isinstance(out, Exception), out
        assert [c.device_id for c in out.contributors] == ["dev-0", "dev-1", "dev-2"]  # type: ignore[attr-defined]
        assert np.allclose(out.delta["w"], 1.0)  # type: ignore[attr-defined]
    assert isinstance(results[3], Exception), "the stranger must find no group"


def test_group_plans_name_the_peers_devices_announced_and_no_clashing_one(
    tmp_path: Path,
) -> None:
    from flotilla.server.hosting.rendezvous import HostedRendezvous

    rendezvous = HostedRendezvous(tmp_path)  # its peer process starts only when asked for
    p, q = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "Qm" + "a" * 44
    for device, peer in (("a", p), ("b", p), ("c", q)):
        rendezvous.peer_seen(device, peer)
    assert rendezvous.members(["c", "d"]) == {q: "c"}  # d announced no peer
    assert rendezvous.members(["a", "c"]) == {p: "a", q: "c"}
    assert rendezvous.members(["a", "b", "c"]) == {q: "c"}  # p claimed twice: neither
    with pytest.raises(WireError, match="peer id"):
        rendezvous.peer_seen("e", "not a peer id")


def test_members_check_peer_ids_and_the_device_ids_they_gather() -> None:
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.p2p import PeerID
    from hivemind.utils import MSGPackSerializer as msgpack

    from flotilla.p2p.averaging import StrangerInGroup, check_members

    a, b = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"), PeerID(b"x" * 34)

    def gathered(device: object) -> bytes:
        return msgpack.dumps([1.0, 0, msgpack.dumps({"device_id": device, "num_samples": 1})])

    group = GroupInfo(b"g", (a, b), (gathered("dev-a"), gathered("dev-b")))
    named = {a.to_base58(): "dev-a", b.to_base58(): "dev-b"}
    check_members(group, named)  # every peer named, each its own device
    with pytest.raises(StrangerInGroup, match="not one the server selected"):
        check_members(group, {a.to_base58(): "dev-a"})
    with pytest.raises(StrangerInGroup, match="claims to be another device"):
        check_members(group, {a.to_base58(): "dev-a", b.to_base58(): "dev-c"})
    posing = GroupInfo(b"g", (a, b), (gathered("dev-a"), b"\xc1junk"))
    with pytest.raises(StrangerInGroup, match="malformed"):
        check_members(posing, named)


def _agreed_hashes(logs: Path) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for path in logs.glob("agent-*.log"):
        text = path.read_text(errors="replace")
        for match in re.finditer(r"round (\d+) of \S+: agreed model ([0-9a-f]{64})", text):
            found.setdefault(int(match.group(1)), []).append(match.group(2))
    return found


def _processes_matching(pattern: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if re.search(pattern, cmdline):
            found.append(int(proc.name))
    return found


def _wait_for_line(path: Path, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if found := re.search(pattern, text):
            return found
        time.sleep(0.05)
    raise AssertionError(f"{path.name} never logged {pattern!r}; it ends:\n{text[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(540)
def test_p2p_digits_job_commits_the_models_agents_agreed_on_despite_a_kill(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, tmp_path: Path
) -> None:
    fleet.start(5)
    job_id = server.submit(
        digits_spec, "job.name=p2p", "aggregation.transport=p2p", "compression.uplink=int8",
        "job.clients_per_round=5", "job.min_quorum=3", "job.rounds=8",
        "job.round_deadline_s=40", "aggregation.matchmaking_s=4",
    )  # fmt: skip
    victim_log = tmp_path / "agent-2.log"
    # Killed while joining its group (mid-round) in round 3 or later, whichever it is in
    # first: on a loaded machine an agent may miss an early round's deadline.
    averaging = _wait_for_line(victim_log, r"round ([3-6]) of \S+: averaging", 200)
    fleet.procs[2].send_signal(signal.SIGKILL)
    killed_in = int(averaging.group(1))
    victim = re.search(r"enrolled as (\S+)", victim_log.read_text())
    assert victim is not None

    status = server.wait_for(job_id, timeout=300)
    assert status["state"] == "completed", status
    assert status["metrics"]["accuracy"] >= 0.90, status
    rounds = server.status(job_id, rounds=True)["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, 9))
    agreed = _agreed_hashes(tmp_path)
    for r in rounds:
        sha = r["checkpoint_sha256"]
        # The committed model is the one a quorum of agents built and reported.
        assert agreed.get(r["round"], []).count(sha) >= 3, (r["round"], sha, agreed)
        assert r["metrics"]["p2p_reports"] >= 3
        assert r["metrics"]["p2p_contributors"] == len(r["participants"]) >= 3
        assert r["committed_at"] - r["started_at"] < 40  # the kill blocked no round
    after = [r for r in rounds if r["round"] > killed_in]
    assert all(victim.group(1) not in r["participants"] for r in after)

    # The killed agent's hivemind workers (forked: same command line) died with it.
    assert not _processes_matching(r"flotilla client .*--shard 2/5")

    exported = tmp_path / "model.safetensors"
    server.operator("job", "export", job_id, "--out", str(exported))
    digest = hashlib.sha256(exported.read_bytes()).hexdigest()
    assert digest == rounds[-1]["checkpoint_sha256"]


def test_group_plan_round_trips_and_refuses_nonsense() -> None:
    plan = GroupPlan(("/ip4/127.0.0.1/tcp/1/p2p/Qm",), 5, 3, 4.0, "int8", server_lr=0.5)
    assert GroupPlan.from_dict(plan.to_dict()) == plan
    named = dataclasses.replace(plan, members={"QmPeer": "dev-1"})
    assert GroupPlan.from_dict(named.to_dict()) == named
    with pytest.raises(WireError):
        GroupPlan.from_dict({**plan.to_dict(), "members": {"QmPeer": 7}})
    with pytest.raises(WireError):
        GroupPlan.from_dict({**plan.to_dict(), "min_group_size": 9})
    with pytest.raises(WireError):
        GroupPlan.from_dict({"group_size": 2})
    assert dataclasses.replace(plan, group_size=3).group_size == 3
