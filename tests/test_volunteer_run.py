"""A volunteer run as users start it: ``flotilla volunteer coordinate`` and ``flotilla volunteer``
as separate processes, real hivemind peers on 127.0.0.1, the char LM on stdlib docstrings."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from flotilla.tasks.charlm import VOCAB, CharLMTask
from tests.support.docrun import REPO, parse_blocks, run_page
from tests.support.lifetime import bound

#: A model that learned nothing predicts every character alike: its loss is ln(VOCAB)
#: (4.56). A volunteer that started from the swarm's state is well below it, even on the
#: one noisy step a late joiner may get in an epoch.
LEARNED_LOSS = math.log(VOCAB) - 0.3

# Hivemind swarms are timing-bound: the tests of one group run one at a time on one worker
# (volunteer runs in one group, server-coordinated and all-reduce rounds in the other).
pytestmark = pytest.mark.xdist_group("hivemind-volunteers")

TASK = "flotilla.tasks.charlm:CharLMTask"
PLAIN_PEER = Path(__file__).resolve().parents[1] / "examples" / "plain_hivemind_peer.py"
AVERAGING_TIMEOUT_S = 15.0
RUN_OPTS = [
    "--target-batch-size", "96",
    "--batch-size", "16",
    "--matchmaking-time", "2",
    "--averaging-timeout", str(AVERAGING_TIMEOUT_S),
    "--learning-rate", "0.005",
]  # fmt: skip


@pytest.fixture(scope="module")
def corpus_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Build the corpus once; every peer process reads it from this cache."""
    cache = tmp_path_factory.mktemp("cache")
    CharLMTask(cache).tokens()
    # PYTHONFAULTHANDLER: a peer that hangs is sent SIGABRT and prints every thread's stack.
    return {
        **os.environ,
        "FLOTILLA_CACHE_DIR": str(cache),
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }


class Peers:
    """Processes started for one test; every one is killed at the end, whatever happens."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.env, self.workdir = env, workdir
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[str]:
        """``flotilla ARGS`` as process ``name``."""
        return self.start_argv(name, [sys.executable, "-m", "flotilla", *args])

    def start_argv(self, name: str, argv: list[str]) -> subprocess.Popen[str]:
        err = open(self.workdir / f"{name}.err", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            bound(argv),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=self.env,
            cwd=self.workdir,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.err").read_text()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
def peers(corpus_env: dict[str, str], tmp_path: Path) -> Iterator[Peers]:
    group = Peers(corpus_env, tmp_path)
    try:
        yield group
    finally:
        group.close()


def _coordinate(peers: Peers, run: str, state_dir: Path, *extra: str) -> str:
    coord = peers.start(
        "coordinator",
        "volunteer", "coordinate", "--run", run, "--task", TASK, "--state-dir", str(state_dir),
        *RUN_OPTS, *extra,
    )  # fmt: skip
    assert coord.stdout is not None
    line = coord.stdout.readline().strip()  # the contract: multiaddrs first, one per line
    assert line.startswith("/ip4/127.0.0.1/tcp/"), (line, peers.log("coordinator"))
    return line


def _volunteer(peers: Peers, name: str, run: str, maddr: str, *extra: str) -> Any:
    return peers.start(
        name, "volunteer", "--run", run, "--task", TASK, "--initial-peers", maddr, *extra
    )


def _stacks(peers: Peers, proc: subprocess.Popen[str], name: str) -> str:
    """Why a peer did not stop: its signal masks, then every thread's stack (SIGABRT makes
    the fault handler print them) at the end of its log."""
    masks = [
        line
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
    ]
    proc.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return "\n".join(masks) + "\n" + peers.log(name)[-12000:]


def _report(volunteer: subprocess.Popen[str]) -> dict[str, Any]:
    """The report a stopped volunteer printed: its stdout's last JSON line."""
    assert volunteer.stdout is not None
    lines = [line for line in volunteer.stdout.read().splitlines() if line.startswith("{")]
    assert lines, "a stopped volunteer prints what it did"
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _status(peers: Peers, run: str, maddr: str) -> dict[str, Any]:
    out = subprocess.run(
        bound([sys.executable, "-m", "flotilla", "volunteer", "status", "--run", run,
         "--initial-peers", maddr, "--json"]),
        # A hang catcher only: the command bounds itself (its DHT start and record wait,
        # Timeouts.dht_start_s + record_wait_s); a loaded 2-core run needed over 60 s.
        capture_output=True, text=True, env=peers.env, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _wait(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _peer_epochs(run: str, maddr: str) -> dict[str, int]:
    """Each volunteer's epoch, from its own latest signed metrics in the DHT."""
    from flotilla.p2p import read_metrics, start_dht

    dht = start_dht([maddr], client_mode=True)
    try:
        return {m.peer: m.epoch for m in read_metrics(dht, run)}
    finally:
        dht.shutdown()


def _peer_id(peers: Peers, name: str) -> str:
    """The peer id a volunteer announced on joining (``joined run RUN as PEER``)."""
    for line in peers.log(name).splitlines():
        if line.startswith("joined run "):
            return line.rsplit(" ", 1)[-1]
    raise AssertionError(f"{name} has not joined: {peers.log(name)[-2000:]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_volunteers_train_survive_kills_catch_up_late_and_resume_after_all_left(
    peers: Peers, tmp_path: Path
) -> None:
    run = "charlm"
    maddr = _coordinate(peers, run, tmp_path / "coord")
    volunteers = [_volunteer(peers, f"v{i}", run, maddr) for i in range(4)]
    _wait("epoch 3", lambda: _status(peers, run, maddr)["epoch"] >= 3, 240, every=2.0)

    # kill -9 one volunteer mid-run: the others finish their next epoch within 2x the
    # averaging timeout.
    ids = [_peer_id(peers, f"v{i}") for i in range(4)]
    victim = psutil.Process(volunteers[0].pid)
    tree = [victim.pid, *(p.pid for p in victim.children(recursive=True))]
    os.killpg(volunteers[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # hivemind hands tensors between its processes as /dev/shm files by default, which a
    # kill -9 leaves behind (hundreds a peer); flotilla's peers hand them as descriptors.
    shm = Path("/dev/shm")
    left = [f.name for f in shm.glob("torch_*") if int(f.name.split("_")[1]) in tree]
    assert not left, f"{len(left)} shared-memory files of a killed volunteer: {left[:5]}"
    before = _peer_epochs(run, maddr)
    _wait(
        "every survivor to finish an epoch",
        lambda: (lambda now: all(now.get(p, -1) > before.get(p, -1) for p in ids[1:]))(
            _peer_epochs(run, maddr)
        ),
        timeout=2 * AVERAGING_TIMEOUT_S,
        every=0.5,
    )
    assert time.monotonic() - killed_at <= 2 * AVERAGING_TIMEOUT_S + 5

    # A late joiner downloads the current state and trains on the current epoch.
    epoch_now = _status(peers, run, maddr)["epoch"]
    late = _volunteer(peers, "late", run, maddr, "--max-epochs", "2")
    out, _ = late.communicate(timeout=240)
    joined = json.loads(out.strip().splitlines()[-1])
    assert joined["first_epoch"] >= epoch_now - 1 >= 2, (joined, peers.log("late"))
    assert joined["last_epoch"] >= joined["first_epoch"] + 2
    assert min(joined["epoch_losses"].values()) < LEARNED_LOSS, joined  # not a fresh model

    status = _wait(
        "five epochs of loss history",
        lambda: (lambda s: len(s["loss_history"]) >= 5 and s)(_status(peers, run, maddr)),
        240,
        every=2.0,
    )
    history = [loss for _, loss in status["loss_history"]]
    assert history[-1] < history[0] - 0.3, history  # the swarm is learning
    assert status["peers_online"] >= 3
    assert status["samples_per_second"] > 0
    assert status["checkpoint_epoch"] is not None and status["checkpoint_epoch"] >= 3
    assert {"run", "epoch", "peers_online", "samples_per_second", "loss", "loss_history"} <= set(
        status
    )
    for proc in volunteers[1:]:
        assert proc.poll() is None, "a survivor stopped"

    # Every volunteer leaves (kill -9); two new ones resume from the coordinator's last
    # checkpoint, not from scratch.
    checkpoint = _status(peers, run, maddr)["checkpoint_epoch"]
    for proc in volunteers[1:]:
        os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "coord" / "checkpoint.safetensors").exists()
    second = [_volunteer(peers, f"b{i}", run, maddr, "--max-epochs", "1") for i in range(2)]
    for i, proc in enumerate(second):
        out, _ = proc.communicate(timeout=240)
        report = json.loads(out.strip().splitlines()[-1])
        assert report["first_epoch"] >= checkpoint, (report, peers.log(f"b{i}"))
        assert min(report["epoch_losses"].values()) < LEARNED_LOSS, report


@pytest.mark.timeout(300)
def test_a_volunteer_refuses_a_run_of_another_task_or_coordinator(
    peers: Peers, tmp_path: Path
) -> None:
    run = "guarded"
    maddr = _coordinate(peers, run, tmp_path / "coord")
    wrong_task = peers.start(
        "wrong-task", "volunteer", "--run", run, "--task", "flotilla.tasks.digits:DigitsTask",
        "--initial-peers", maddr,
    )  # fmt: skip
    assert wrong_task.wait(timeout=120) == 1
    assert "trains task 'flotilla.tasks.charlm:CharLMTask'" in peers.log("wrong-task")

    impostor = _volunteer(peers, "pinned", run, maddr, "--coordinator-key", "A" * 43 + "=")
    assert impostor.wait(timeout=120) == 1
    assert "not the coordinator key" in peers.log("pinned")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_federation_server_coordinates_a_volunteer_run_and_lists_it(
    peers: Peers, tmp_path: Path, process_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.processes import ServerProcess

    monkeypatch.setenv("FLOTILLA_CACHE_DIR", peers.env["FLOTILLA_CACHE_DIR"])
    server = ServerProcess(
        tmp_path / "state", process_db_url, extra=("--liveness", "6", "--p2p", f"lm={TASK}")
    )
    server.start(timeout=90)
    try:

        def runs() -> list[dict[str, Any]]:
            out = subprocess.run(
                bound([sys.executable, "-m", "flotilla", "volunteer", "runs", "--server",
                 server.address, "--state-dir", str(server.state_dir), "--json"]),
                capture_output=True, text=True, env=peers.env, timeout=60, check=True,
            )  # fmt: skip
            return json.loads(out.stdout)  # type: ignore[no-any-return]

        (listed,) = runs()
        assert listed["run"] == "lm" and listed["task"] == TASK
        assert listed["maddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
        joined = _volunteer(
            peers, "v", "lm", listed["maddrs"][0],
            "--coordinator-key", listed["coordinator_key"], "--max-epochs", "2",
        )  # fmt: skip
        out, _ = joined.communicate(timeout=200)
        report = json.loads(out.strip().splitlines()[-1])
        assert report["last_epoch"] >= 2, peers.log("v")
        status = _wait(
            "the server to report the run's epochs",
            lambda: (lambda r: r["status"] and r["status"]["epoch"] >= 2 and r)(runs()[0]),
            60,
            every=2.0,
        )["status"]
        assert status["loss_history"] and status["loss_history"][-1][1] < 4.5
        unauthenticated = subprocess.run(
            bound([sys.executable, "-m", "flotilla", "volunteer", "runs", "--server",
             server.address, "--token", "not-a-token"]),
            capture_output=True, text=True, env=peers.env, timeout=60,
        )  # fmt: skip
        assert unauthenticated.returncode == 3, unauthenticated.stderr
        # A server killed with -9 takes its hosted coordinator with it (a survivor would
        # hold the run's identity against the restarted server).
        assert server.proc is not None
        hosted = [
            p for p in psutil.Process(server.proc.pid).children() if "coordinate" in p.cmdline()
        ]
        assert len(hosted) == 1, hosted
        server.kill9()
        _, alive = psutil.wait_procs(hosted, timeout=60)
        assert not alive, "the hosted coordinator outlived its server"

        # Restarted, the server hosts the run again; Ctrl-C (SIGINT) stops the server and
        # its coordinator, with the coordinator's own workers, within 5 s.
        server.start(timeout=90)
        assert [r["run"] for r in runs()] == ["lm"]
        assert server.proc is not None
        (coordinator,) = [
            p for p in psutil.Process(server.proc.pid).children() if "coordinate" in p.cmdline()
        ]
        tree = [coordinator, *coordinator.children(recursive=True)]
        began = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=5)
        _, alive = psutil.wait_procs(tree, timeout=max(0.1, 5 - (time.monotonic() - began)))
        assert not alive, f"left behind after Ctrl-C: {[p.name() for p in alive]}"
        print(f"server and coordinator stopped {time.monotonic() - began:.1f} s after SIGINT")
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crashed_coordinator_restarts_with_its_peer_id_and_its_run(
    peers: Peers, tmp_path: Path
) -> None:
    """Volunteers' --initial-peers name the coordinator's peer id: it must survive restarts."""
    state = tmp_path / "coord"
    first = _coordinate(peers, "stable", state)
    coordinator = peers.procs[-1]
    os.killpg(coordinator.pid, signal.SIGKILL)  # a crash: nothing saved on the way out
    coordinator.wait(timeout=60)
    second = _coordinate(peers, "stable", state)
    assert first.rsplit("/p2p/", 1)[1] == second.rsplit("/p2p/", 1)[1]
    record = json.loads((state / "record.json").read_text())
    assert record["run"] == "stable" and record["task"] == TASK


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["verified", "plain"])
def test_ctrl_c_stops_peers_with_their_workers_and_a_healthy_run_logs_no_error(
    peers: Peers, tmp_path: Path, mode: str
) -> None:
    """A run as volunteers live it: one trains, a second joins late and leaves by Ctrl-C,
    then Ctrl-C stops the first (its whole process group, as a terminal sends it) and the
    coordinator. Each exits within 5 s and leaves no p2pd or hivemind worker behind
    (hivemind's own averagers ignore SIGINT in the process that starts them; flotilla's
    leave it alone, in runs open to plain peers too), and no log holds an ERROR line or a
    traceback; the coordinator warns of the peer that left at most once."""
    run = f"ctrl-c-{mode}"
    extra = ("--plain-averaging",) if mode == "plain" else ()
    maddr = _coordinate(peers, run, tmp_path / "coord", *extra)
    coordinator = peers.procs[0]
    volunteer = _volunteer(peers, "v1", run, maddr)
    _wait("the volunteer to join", lambda: "joined run " in peers.log("v1"), 120)
    _wait("an epoch", lambda: any(e >= 1 for e in _peer_epochs(run, maddr).values()), 120)

    late = _volunteer(peers, "v2", run, maddr)
    _wait("the late volunteer to join", lambda: "joined run " in peers.log("v2"), 120)
    leaver = _peer_id(peers, "v2")
    joined_at = _peer_epochs(run, maddr).get(leaver, -1)
    _wait("its epoch", lambda: _peer_epochs(run, maddr).get(leaver, -1) > joined_at, 120)
    os.killpg(late.pid, signal.SIGINT)
    assert late.wait(timeout=5) == 130, peers.log("v2")[-3000:]
    # What it did is printed on Ctrl-C, before it leaves: a hard stop cannot lose it.
    report = _report(late)
    assert report["peer"] == leaver and report["steps"] > 0, report
    stayer = _peer_id(peers, "v1")
    left_at = _peer_epochs(run, maddr)[stayer]
    _wait("an epoch without it", lambda: _peer_epochs(run, maddr)[stayer] > left_at, 120)

    for proc, group, name in ((volunteer, True, "v1"), (coordinator, False, "coordinator")):
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert tree, "a peer runs its p2pd and hivemind workers as children"
        began = time.monotonic()
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"SIGINT ignored:\n{_stacks(peers, proc, name)}") from None
        took = time.monotonic() - began
        _, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive, f"left behind: {[p.name() for p in alive]}"
        print(
            f"{mode}: {'volunteer' if group else 'coordinator'} stopped {took:.1f} s after SIGINT"
        )
        # Ctrl-C is status 130 (docs/cli.md); the coordinator serves until stopped.
        assert proc.returncode == (130 if group else 0)
        if group:
            assert _report(proc)["peer"] == stayer
    for name in ("coordinator", "v1", "v2"):
        log = peers.log(name)
        noisy = [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]
        assert not noisy, f"{name}:\n{log[-4000:]}"
        # A goodbye takes 0.1-0.2 s here; a loaded machine may need the hard stop (3 s).
        print(f"{mode}: {name} {'hard stop' if 'ending now' in log else 'goodbye'}")
    said = [line for line in peers.log("coordinator").splitlines() if "WARN" in line]
    assert sum(leaver in line for line in said) <= 1, said


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_a_coordinator_whose_checkpoint_download_hangs_on_a_frozen_peer(
    peers: Peers, tmp_path: Path
) -> None:
    """A coordinator downloads the run's state from a volunteer that froze (SIGSTOP: no
    answer, no closed connection), which may take the record's ``load_state_timeout``.
    Ctrl-C still stops it within 5 s, cleanly (status 0, not the hard stop's 130): its duties
    run beside the main thread, which Python wakes for the signal's handler."""
    maddr = _coordinate(peers, "frozen", tmp_path / "coord")
    coordinator = peers.procs[0]
    volunteer = _volunteer(peers, "v1", "frozen", maddr)
    _wait("a checkpoint", lambda: "checkpoint of epoch" in peers.log("coordinator"), 180)

    def download_hangs() -> bool:
        log = peers.log("coordinator")[seen:]
        return "Downloading parameters" in log.rsplit("Finished downloading", 1)[-1]

    for _ in range(3):  # frozen right after a checkpoint, nothing may be due: thaw, retry
        seen = len(peers.log("coordinator"))
        os.killpg(volunteer.pid, signal.SIGSTOP)
        try:
            _wait("a download from the frozen peer", download_hangs, 15, every=0.2)
            break
        except AssertionError:
            os.killpg(volunteer.pid, signal.SIGCONT)
            time.sleep(2)
    else:
        raise AssertionError("the coordinator never downloaded from the frozen volunteer")
    time.sleep(1)
    assert download_hangs()
    began = time.monotonic()
    coordinator.send_signal(signal.SIGINT)
    try:
        coordinator.wait(timeout=5)
    except subprocess.TimeoutExpired:
        stacks = _stacks(peers, coordinator, "coordinator")
        raise AssertionError(f"SIGINT ignored:\n{stacks}") from None
    print(f"coordinator stopped {time.monotonic() - began:.1f} s after SIGINT")
    assert coordinator.returncode == 0, peers.log("coordinator")[-3000:]
    os.killpg(volunteer.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_verified_run_refuses_a_plain_hivemind_peer_at_once_naming_the_option(
    peers: Peers, tmp_path: Path
) -> None:
    maddr = _coordinate(peers, "closed", tmp_path / "coord")
    began = time.monotonic()
    plain = peers.start_argv(
        "plain", [sys.executable, str(PLAIN_PEER), "--run", "closed", "--initial-peers", maddr]
    )
    assert plain.wait(timeout=120) == 3, peers.log("plain")[-3000:]
    assert time.monotonic() - began < 60
    assert "--plain-averaging" in peers.log("plain")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_plain_hivemind_peer_averages_in_a_run_open_to_it_and_its_loss_falls(
    peers: Peers, tmp_path: Path
) -> None:
    """examples/plain_hivemind_peer.py as written, beside a flotilla volunteer, in a run
    whose coordinator was started with --plain-averaging: the two kinds of peer reach each
    other's averagers (hivemind's own handler names) and average."""
    maddr = _coordinate(peers, "open", tmp_path / "coord", "--plain-averaging")
    _volunteer(peers, "v1", "open", maddr)
    plain = peers.start_argv(
        "plain",
        [sys.executable, str(PLAIN_PEER), "--run", "open", "--initial-peers", maddr,
         "--epochs", "20"],
    )  # fmt: skip
    assert plain.wait(timeout=300) == 0, peers.log("plain")[-3000:]
    log = peers.log("plain")
    # hivemind's own lines: gradients averaged in an epoch, parameters averaged after one.
    averaged = [line for line in log.splitlines() if re.search(r"Averaged \w+ with [2-9]", line)]
    assert len(averaged) >= 3, log[-3000:]
    assert plain.stdout is not None
    losses = [float(line.split()[-1]) for line in plain.stdout.read().splitlines()
              if line.startswith("epoch ")]  # fmt: skip
    assert len(losses) >= 20
    # It trains on the swarm's state: below a fresh model's loss and, unless it joined a
    # swarm already near its plateau (a loaded machine starts it late), still falling.
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < LEARNED_LOSS and (last < first or last < LEARNED_LOSS - 0.3), losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_delayed_averaging_averages_gradients_while_the_next_epoch_computes(
    peers: Peers, tmp_path: Path
) -> None:
    """``coordinate --delayed-averaging``: a verified gradient run whose rounds run beside
    the next epoch's compute (hivemind's delayed gradient averaging): peers still average
    whole rounds, and learn."""
    run = "delayed"
    # An epoch longer than matchmaking (2 s) and a round: with shorter ones hivemind's
    # pre-scheduled rounds pile up behind each other and find no group (docs/p2p.md).
    # A lone peer's round (its partner not there yet) gives up after 6 s, not 15: the
    # rounds scheduled behind it then meet the partner sooner.
    maddr = _coordinate(
        peers, run, tmp_path / "coord", "--delayed-averaging", "--target-batch-size", "288",
        "--averaging-timeout", "6",
    )  # fmt: skip
    assert json.loads((tmp_path / "coord" / "record.json").read_text())["delayed_averaging"]
    volunteers = [_volunteer(peers, f"v{i}", run, maddr, "--max-epochs", "8") for i in range(2)]
    for i, proc in enumerate(volunteers):
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, peers.log(f"v{i}")[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert report["averaged_epochs"] >= 2, (report, peers.log(f"v{i}")[-3000:])
        losses = [report["epoch_losses"][k] for k in sorted(report["epoch_losses"], key=int)]
        assert losses[-1] < losses[0] - 0.2, losses
        noisy = [line for line in peers.log(f"v{i}").splitlines() if "ERROR" in line]
        assert not noisy, peers.log(f"v{i}")[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_gossip_run_mixes_volunteers_and_a_late_one_joins_light(
    peers: Peers, tmp_path: Path, mode: str
) -> None:
    """``coordinate --averaging gossip``: volunteers mix parameters with a neighbour every
    epoch, with no group to form; one joining later joins light and takes its neighbours'
    parameters at its first mix (its losses are a trained model's, not a fresh one's)."""
    run = f"gossip-{mode}"
    gossip = ("--averaging", "gossip", "--gossip-mode", mode, "--gossip-wait", "5")
    maddr = _coordinate(peers, run, tmp_path / "coord", *gossip)
    first = [_volunteer(peers, f"v{i}", run, maddr) for i in range(2)]
    _wait(
        "epoch 6 on both",
        lambda: len(e := _peer_epochs(run, maddr)) == 2 and min(e.values()) >= 6,
        180,
        every=2.0,
    )
    late = _volunteer(peers, "late", run, maddr)
    _wait("the late volunteer to join", lambda: "joined run " in peers.log("late"), 120)
    late_id = _peer_id(peers, "late")
    _wait("its metrics", lambda: late_id in _peer_epochs(run, maddr), 60)
    time.sleep(10)  # a few epochs with it
    status = _status(peers, run, maddr)
    assert status["peers_online"] >= 2 and status["epoch"] >= 6, status
    # The peers' sketches say how far apart they are (how close mixing keeps them is
    # measured by benchmarks/p2p_gossip.py; the estimate's accuracy by test_gossip.py).
    assert status["averaging"] == "gossip", status
    print(f"{mode}: consensus distance {status['consensus_distance']}")
    distance = status["consensus_distance"]
    assert distance is not None and 0.0 < distance < math.inf, status

    reports = {}
    for name, proc in (("late", late), ("v0", first[0]), ("v1", first[1])):
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 130, peers.log(name)[-3000:]
        reports[name] = _report(proc)
    joined = reports.pop("late")
    assert joined["first_epoch"] >= 6 and joined["averaged_epochs"] >= 2, joined
    assert min(joined["epoch_losses"].values()) < LEARNED_LOSS, joined  # not a fresh model
    for report in reports.values():
        epochs = report["last_epoch"] - report["first_epoch"]
        # sync: most epochs mix with a neighbour (not the first ones, before the peers
        # meet); async never waits for a step in flight, so it mixes as often as the link
        # lets it (on loopback about every second or third epoch of this small model).
        share = 2 if mode == "sync" else 10
        assert epochs >= 6 and report["averaged_epochs"] >= max(3, epochs / share), report
        losses = [report["epoch_losses"][k] for k in sorted(report["epoch_losses"], key=int)]
        assert losses[-1] < losses[0] - 0.3, losses
    for name in ("coordinator", "v0", "v1", "late"):
        noisy = [line for line in peers.log(name).splitlines() if "ERROR" in line]
        assert not noisy, f"{name}:\n{peers.log(name)[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_gossip_run_checkpoints_names_neighbours_and_resumes_after_everyone_left(
    peers: Peers, tmp_path: Path
) -> None:
    """A gossip run's coordinator checkpoints the members' mean state and `status --json`
    names each peer's neighbours; when every volunteer is gone and the coordinator itself
    crashed and restarted, a new volunteer resumes from the checkpoint, not from scratch."""
    run, state = "gossip-resume", tmp_path / "coord"
    gossip = ("--averaging", "gossip", "--gossip-wait", "5")
    maddr = _coordinate(peers, run, state, *gossip)
    first = [_volunteer(peers, f"v{i}", run, maddr) for i in range(2)]
    for i in range(2):
        _wait(f"v{i} to join", lambda i=i: "joined run " in peers.log(f"v{i}"), 120)
    ids = [_peer_id(peers, f"v{i}") for i in range(2)]

    def mixed_and_saved() -> dict[str, Any] | None:
        status = _status(peers, run, maddr)
        checkpoint, neighbours = status["checkpoint_epoch"], status["neighbours"] or {}
        both = all(neighbours.get(p) for p in ids)
        return status if checkpoint is not None and checkpoint >= 4 and both else None

    status = _wait("a checkpoint at epoch 4 and both peers mixing", mixed_and_saved, 240, 2.0)
    assert status["checkpoint_peer"] == maddr.rsplit("/p2p/", 1)[1], status
    assert status["neighbours"] == {ids[0]: [ids[1]], ids[1]: [ids[0]]}, status

    # Everyone leaves (kill -9), the coordinator crashes; it restarts with its checkpoint.
    for proc in [*first, peers.procs[0]]:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    maddr = _coordinate(peers, run, state, *gossip)
    saved = _status(peers, run, maddr)["checkpoint_epoch"]
    assert saved is not None and saved >= status["checkpoint_epoch"]
    late = _volunteer(peers, "late", run, maddr, "--max-epochs", "2")
    out, _ = late.communicate(timeout=240)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["first_epoch"] >= saved, (report, peers.log("late")[-3000:])
    assert f"resumed from the run's checkpoint of epoch {saved}" in peers.log("late")
    assert min(report["epoch_losses"].values()) < LEARNED_LOSS, report  # not a fresh model


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gossip_example_in_the_docs_runs_as_written(
    corpus_env: dict[str, str], tmp_path: Path
) -> None:
    """docs/p2p.md's gossip example, run by bash as a reader would: it ends by itself,
    `status` answers, and both volunteers mix most of their 20 epochs."""
    blocks = parse_blocks((REPO / "docs" / "p2p.md").read_text())
    (block,) = [b for b in blocks if b.runs and "--run docs-gossip" in b.text]
    page = tmp_path / "gossip.md"
    page.write_text(f"```bash\n{block.text}```\n")
    run = run_page(page, tmp_path, 240, corpus_env)
    assert run.timed_out_block is None and run.returncode == 0, run.output[-3000:]
    out = run.output
    # Its status line (neighbours and consensus appear when it runs while they train:
    # how fast 20 epochs go depends on the machine; test_a_gossip_run_checkpoints_names_
    # neighbours... checks those fields).
    assert "run docs-gossip: epoch " in out, out
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(reports) == 2, out
    for report in reports:
        assert report["last_epoch"] - report["first_epoch"] == 20, report
        assert report["averaged_epochs"] >= 10, report
    assert "ERROR" not in out, out[-3000:]
