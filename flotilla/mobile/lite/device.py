"""The lite client's life: enrol once, then poll, fetch, train and upload until stopped.

Each step is a protocol call of docs/protocol.md and nothing more, so this module reads as
the outline of a phone SDK: conditions go with every poll and heartbeat, a round the device
cannot or may no longer do is given up with its reason at once (never left to the
deadline), and transfers resume after a broken link (``HttpDevice``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    ForbiddenError,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)
from flotilla.core.flat import secure_input
from flotilla.core.identity import DeviceIdentity
from flotilla.core.measure import matmul_gflops, memory_bytes
from flotilla.core.round_config import RoundConfig
from flotilla.core.tensors import ModelState
from flotilla.core.work import RoundRef
from flotilla.mobile.lite.conditions import LiteConditions, job_policy, stop_check
from flotilla.mobile.lite.http import HttpDevice, OfferedTask
from flotilla.mobile.lite.mlp import StopCheck, Stopped
from flotilla.mobile.lite.rounds import LiteTrainer
from flotilla.mobile.lite.state import LiteState
from flotilla.secagg import SecAggConfig, SecAggDevice, SecAggRefused, Session, Stage

log = logging.getLogger(__name__)

#: Pause after the server could not be reached (HttpDevice has already retried).
AWAY_PAUSE_S = 2.0
#: Beyond the server's wait for a secure round's stage, what its reply may take.
SECAGG_SLACK_S = 10.0

#: Builds the device's SecAgg+ party: (config, session, device id, identity key, update,
#: weight), as ``flotilla.secagg.SecAggDevice`` takes them.
SecAggFactory = Callable[
    [SecAggConfig, Session, str, Ed25519PrivateKey, np.ndarray, int], SecAggDevice
]


@dataclass(frozen=True, slots=True)
class ServedRound:
    """What became of one offered round, for logs and tests."""

    job_id: str
    round: int
    #: ``accepted``, ``refused``, ``gave_up`` or ``stale``.
    outcome: str
    detail: str = ""


class LiteDevice:
    """One torch-free device serving one server."""

    def __init__(
        self,
        http: HttpDevice,
        state: LiteState,
        trainer: LiteTrainer,
        conditions: LiteConditions,
        device_class: str = "",
        secagg_device: SecAggFactory = SecAggDevice,
    ) -> None:
        """``secagg_device``: builds its SecAgg+ party (a seam for tests); the party signs
        with the identity key the device registered at enrolment."""
        self.http = http
        self.secagg_device = secagg_device
        self.state = state
        self.trainer = trainer
        self.conditions = conditions
        self.profile = DeviceProfile(
            device_id="",
            tasks=trainer.tasks,
            gflops=matmul_gflops(seconds=0.1),
            memory_bytes=memory_bytes(),
            device_class=device_class,
            samples=trainer.samples,
        )

    def sign_in(self, token: str) -> str:
        """The device id: the saved credential for this server, or a new enrolment
        (AuthError at once when the token is refused)."""
        saved, key = self.state.credential(), self.state.identity()
        if saved is not None and key is not None:
            self.http.credential, self.http.identity = saved, key
            return saved.device_id
        if saved is not None:
            log.warning("enrolled before updates were signed: enrolling again with a key")
        identity = DeviceIdentity.generate()
        credential = self.http.enrol(token, self.profile, identity)
        self.state.save_identity(identity)
        self.state.save_credential(credential)
        log.info("enrolled as %s", credential.device_id)
        return credential.device_id

    def run(self, token: str, stop: threading.Event, max_rounds: int | None = None) -> None:
        """Serve rounds until ``stop`` is set (or ``max_rounds`` were offered)."""
        self.sign_in(token)
        offered = 0
        send_profile = True
        while not stop.is_set() and (max_rounds is None or offered < max_rounds):
            try:
                task = self.http.poll(
                    self.conditions.current(), self.profile if send_profile else None
                )
            except ForbiddenError:
                log.error("this device was revoked by the operator; stopping")
                raise
            except AuthError:
                # The server forgot this device (a new state dir there): enrol again, once.
                if self.state.credential() is None:
                    raise
                log.warning("the server refused this device's credential; enrolling again")
                self.state.forget_credential()
                self.sign_in(token)
                continue
            except Unreachable as exc:
                log.warning("server unreachable (%s); trying again", exc)
                stop.wait(AWAY_PAUSE_S)
                continue
            send_profile = False
            if task is not None:
                offered += 1
                outcome = self.serve(task)
                log.info("job %s round %d: %s %s", outcome.job_id, outcome.round,
                         outcome.outcome, outcome.detail)  # fmt: skip

    def serve(self, task: OfferedTask) -> ServedRound:
        """One offered round, start to end."""
        order = task.order
        ref = order.ref

        def outcome(kind: str, detail: str = "") -> ServedRound:
            return ServedRound(order.job_id, order.round, kind, detail)

        problem = self.trainer.unsupported(order)
        if problem is None and task.transport != "server":
            problem = f"{task.transport} rounds need a peer-to-peer device"
        should_stop = stop_check(job_policy(order.config_json), self.conditions)
        reason = f"unsupported: {problem}" if problem else should_stop()
        if reason:
            return self._give_up(task, reason, outcome)
        try:
            model = self._fetch(task)
            trained = self.trainer.train(order, model, self._watch(task, should_stop))
            if isinstance(trained, Stopped):
                return self._give_up(task, trained.reason, outcome)
            if trained.delta is not None:
                return self._secure(task, trained.delta, trained.num_samples, outcome)
            receipt = self.http.upload(
                order, trained.payload, trained.num_samples, trained.codec, trained.metrics
            )
        except StaleRoundError as exc:
            return outcome("stale", str(exc))
        except UpdateRejected as exc:
            return outcome("refused", str(exc))
        except (WireError, Unreachable) as exc:
            self._quietly_report(ref, f"failed: {exc}")
            return outcome("gave_up", str(exc))
        return outcome("accepted" if receipt.accepted else "refused", receipt.detail)

    def _secure(
        self,
        task: OfferedTask,
        delta: ModelState,
        num_samples: int,
        outcome: Callable[[str, str], ServedRound],
    ) -> ServedRound:
        """A secure round: mask the update with SecAgg+ and answer every stage; a device
        that stops (SecAggRefused) gives the round up with the reason."""
        order = task.order
        plan = RoundConfig.from_json(order.config_json).secagg
        identity = self.http.identity
        assert plan is not None and self.http.credential is not None and identity is not None
        vector, weight = secure_input(delta, num_samples, plan.weighting, plan.l2_clip)
        config = SecAggConfig.from_privacy(plan.privacy, len(plan.participants))
        session = Session(order.job_id, order.round, plan.participants)
        party = self.secagg_device(
            config, session, self.http.credential.device_id, identity.key, vector, weight
        )
        message = b""
        for stage in Stage:
            try:
                body = party.respond(stage, message)
            except SecAggRefused as exc:
                log.warning("job %s round %d: secure round stopped: %s", order.job_id,
                            order.round, exc)  # fmt: skip
                self._quietly_report(order.ref, f"secagg: {exc.reason}")
                return outcome("gave_up", f"secagg: {exc.reason}")
            wait_s = plan.privacy.stage_timeout_s + SECAGG_SLACK_S
            if stage == Stage.ADVERTISE:  # the first stage closes at the round's deadline
                wait_s += max(order.deadline - time.time(), 0.0)
            message = self.http.secagg(order.ref, int(stage), body, wait_s)
        return outcome("accepted", "secure round done")

    def _fetch(self, task: OfferedTask) -> bytes:
        """The round's model, from the state dir when held, else downloaded (resumable)."""
        models = self.state.directory / "models"
        models.mkdir(parents=True, exist_ok=True)
        dest = models / f"{task.order.model_sha256}.safetensors"
        if not dest.exists():
            self.http.download_model(task.order, dest)
            for old in models.glob("*.safetensors"):
                if old != dest:
                    old.unlink(missing_ok=True)
        return dest.read_bytes()

    def _watch(self, task: OfferedTask, should_stop: StopCheck) -> StopCheck:
        """Between batches: the conditions, and every ``heartbeat_every_s`` a heartbeat
        (a sign of life that carries them; a closed round stops the work)."""
        every = self.http.timeouts.heartbeat_every_s
        last = [time.monotonic()]
        token = task.order.round_token

        def check() -> str | None:
            why = should_stop()
            if why is None and time.monotonic() - last[0] >= every:
                last[0] = time.monotonic()
                try:
                    if not self.http.heartbeat(token, self.conditions.current()):
                        return "the round closed"
                except Unreachable:
                    pass  # keep training; the upload will tell
            return why

        return check

    def _give_up(
        self, task: OfferedTask, reason: str, outcome: Callable[[str, str], ServedRound]
    ) -> ServedRound:
        self._quietly_report(task.order.ref, reason)
        return outcome("gave_up", reason)

    def _quietly_report(self, ref: RoundRef, reason: str) -> None:
        try:
            self.http.report_failure(ref, reason[:400])
        except (StaleRoundError, Unreachable, WireError) as exc:
            log.info("could not report giving up round %s (%s)", ref.round, exc)
