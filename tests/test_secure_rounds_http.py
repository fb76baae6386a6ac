"""A secure round with HTTP devices in it: a real ``flotilla server`` process, 6 gRPC
agents and 4 ``flotilla-lite`` devices (NumPy over HTTP) mask their updates together;
every round unmasks the sum of all ten and the job completes, also when three of the HTTP
devices stop right after sending their masked input."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flotilla.mobile.lite.__main__ import build_parser, check_options
from flotilla.mobile.lite.device import LiteDevice, SecAggFactory
from flotilla.mobile.lite.http import HttpDevice
from flotilla.mobile.lite.rounds import LiteTrainer
from flotilla.mobile.lite.state import LiteState
from flotilla.secagg import SecAggConfig, SecAggDevice, SecAggRefused, Session, Stage
from tests.support.lifetime import bound
from tests.support.processes import AgentFleet, ServerProcess, flotilla, terminate_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DIGITS = "flotilla.tasks.digits:DigitsTask"
DEVICES = 10
AGENTS = 6


def _lite(server: ServerProcess, token: str, shard: Path, state: Path) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "flotilla.mobile.lite", "--server",
        f"http://127.0.0.1:{server.http_port}", "--token", token, "--data", str(shard),
        "--state-dir", str(state), "--device-class", "lite",
    ]  # fmt: skip
    log = (state.parent / f"{state.name}.log").open("w")
    return subprocess.Popen(bound(cmd), stdout=log, stderr=subprocess.STDOUT, text=True)


def _shard(index: int, tmp_path: Path) -> Path:
    """Device ``index``'s digits shard, written by ``flotilla data shard``."""
    shard = tmp_path / f"shard{index}.npz"
    flotilla("data", "shard", "--task", DIGITS, "--shard", f"{index}/{DEVICES}", "--alpha", "0.5",
             "--out", str(shard))  # fmt: skip
    return shard


def test_lite_devices_and_agents_run_secure_rounds_together(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, tmp_path: Path
) -> None:
    fleet.start(AGENTS, of=DEVICES)
    token = server.token()
    lites = []
    for i in range(AGENTS, DEVICES):
        shard = _shard(i, tmp_path)
        lites.append(_lite(server, token, shard, tmp_path / f"lite{i}"))
    try:
        server.wait_devices(DEVICES, timeout=90)
        job_id = server.submit(
            digits_spec, "job.rounds=2", f"job.clients_per_round={DEVICES}",
            f"job.min_quorum={DEVICES - 2}", "privacy.secure_aggregation=true",
            "privacy.stage_timeout_s=20",
        )  # fmt: skip
        status = server.wait_for(job_id, timeout=200)
        assert status["state"] == "completed", status
        lite_ids = {
            d["id"]
            for d in json.loads(server.operator("devices", "list", "--json").stdout)
            if d.get("device_class") == "lite"
        }
        assert len(lite_ids) == DEVICES - AGENTS, lite_ids
        rounds = server.status(job_id, rounds=True)["rounds"]
        assert len(rounds) == 2
        for r in rounds:
            assert r["metrics"]["secagg_survivors"] == DEVICES, r
            assert lite_ids <= set(r["participants"]), r
        assert all(p.poll() is None for p in lites), "a lite client died"
    finally:
        terminate_all(lites)


class StopsAfterMasking(SecAggDevice):
    """A lite device's party that sends its masked input, then goes away (in its first
    secure round only): its neighbours must reveal its self-mask shares instead."""

    stopped: list[tuple[int, str]]

    def respond(self, stage: Stage, message: bytes) -> bytes:
        if stage > Stage.MASKED_INPUT:
            self.stopped.append((self.session.round, self.device_id))
            raise SecAggRefused("out of stage", "test: this device stops after masking")
        return super().respond(stage, message)


def _lite_device(
    server: ServerProcess, token: str, shard: Path, state: Path, factory: SecAggFactory
) -> LiteDevice:
    options = check_options(build_parser().parse_args([
        "--server", f"http://127.0.0.1:{server.http_port}", "--token", token,
        "--data", str(shard), "--state-dir", str(state), "--device-class", "lite",
    ]))  # fmt: skip
    assert options.state_dir is not None
    return LiteDevice(
        HttpDevice(options.server),
        LiteState(options.state_dir, options.server),
        LiteTrainer(options.data, LiteState(options.state_dir, options.server), options.training),
        options.conditions,
        options.device_class,
        secagg_device=factory,
    )


def test_three_http_devices_stop_after_masking_and_the_round_still_unmasks(
    server: ServerProcess, fleet: AgentFleet, digits_spec: Path, tmp_path: Path
) -> None:
    fleet.start(AGENTS, of=DEVICES)
    token = server.token()
    stopped: list[tuple[int, str]] = []
    stoppers = 3

    def factory(index: int) -> SecAggFactory:
        def make(
            config: SecAggConfig, session: Session, device_id: str,
            identity: Ed25519PrivateKey, update: np.ndarray, weight: int,
        ) -> SecAggDevice:  # fmt: skip
            args = (config, session, device_id, identity, update, weight)
            if index < stoppers and session.round == 1:
                party = StopsAfterMasking(*args)
                party.stopped = stopped
                return party
            return SecAggDevice(*args)

        return make

    stop = threading.Event()
    threads = []
    for n, i in enumerate(range(AGENTS, DEVICES)):
        shard = _shard(i, tmp_path)
        device = _lite_device(server, token, shard, tmp_path / f"lite{i}", factory(n))
        thread = threading.Thread(target=device.run, args=(token, stop), daemon=True)
        thread.start()
        threads.append(thread)
    try:
        server.wait_devices(DEVICES, timeout=90)
        job_id = server.submit(
            digits_spec, "job.rounds=2", f"job.clients_per_round={DEVICES}",
            f"job.min_quorum={DEVICES - 3}", "privacy.secure_aggregation=true",
            "privacy.stage_timeout_s=20",
        )  # fmt: skip
        status = server.wait_for(job_id, timeout=200)
        assert status["state"] == "completed", status
        assert len({d for r, d in stopped if r == 1}) == stoppers, stopped
        rounds = server.status(job_id, rounds=True)["rounds"]
        assert [r["round"] for r in rounds] == [1, 2], rounds
        # Their masked inputs are in round 1's sum: all ten survive the masking stage.
        assert rounds[0]["metrics"]["secagg_survivors"] == DEVICES, rounds[0]
        assert rounds[1]["metrics"]["secagg_survivors"] == DEVICES, rounds[1]
        assert all(t.is_alive() for t in threads), "a lite device's thread died"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
