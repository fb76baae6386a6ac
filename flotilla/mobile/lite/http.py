"""The device side of the HTTP device protocol (docs/protocol.md), standard library only.

What a phone SDK does, in Python: enrol, poll with the device's conditions, heartbeat,
download the model resumably (``Range`` into a partial file, SHA-256 checked), upload an
update resumably (chunks at byte offsets; after a broken connection it asks the server
which ranges arrived and sends only the rest), report a failure, leave. Every call has a
deadline from :class:`~flotilla.core.timeouts.Timeouts`; every refusal is raised as the
:mod:`flotilla.core.errors` class the server's status and code name.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.errors import (
    AuthError,
    ConflictError,
    FlotillaError,
    ForbiddenError,
    IntegrityError,
    NotFoundError,
    RateLimited,
    StaleRoundError,
    Unreachable,
    UpdateRejected,
    WireError,
)
from flotilla.core.identity import DeviceIdentity
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import DeviceCredential, RoundRef, WorkOrder

PROTOCOL = 1
PREFIX = "/device/v1"
#: Bytes read from a download's body at a time.
READ_BYTES = 256 * 1024
#: Headers of a secure-round message (docs/protocol.md, "Secure rounds").
ROUND_TOKEN_HEADER = "Flotilla-Round-Token"
#: The largest secure-round reply read (the server's message limit).
MAX_SECAGG_REPLY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class OfferedTask:
    """A round's work as the server offered it over HTTP."""

    order: WorkOrder
    #: ``server`` (upload an update) or ``p2p`` (a server-less round: not for this client).
    transport: str
    max_upload_bytes: int


@dataclass(frozen=True, slots=True)
class DownloadReceipt:
    path: Path
    sha256: str
    size: int
    #: The offsets each resumed request started from (empty: one request sufficed).
    resumed_at: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class UploadReceipt:
    upload_id: str
    accepted: bool
    detail: str
    #: Payload bytes sent in chunks, counting resent ones.
    bytes_sent: int
    #: Calls of this upload whose connection broke, and were survived.
    broken_calls: int


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    body: Any
    #: A refusal's ``Retry-After`` seconds, if it gave one.
    retry_after_s: float | None = None


#: Refusals by status (docs/protocol.md, "Errors"); 422 ``integrity`` is IntegrityError.
_ERRORS: Mapping[int, type[FlotillaError]] = {
    401: AuthError, 403: ForbiddenError, 404: NotFoundError, 409: ConflictError,
    410: StaleRoundError, 422: UpdateRejected, 502: Unreachable, 503: Unreachable,
    504: Unreachable,
}  # fmt: skip


def error_for(status: int, body: Any, retry_after_s: float | None = None) -> FlotillaError:
    """The core error a refusal stands for (429: RateLimited, to wait ``Retry-After``)."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    code, message = str(error.get("code", "")), str(error.get("message", "") or "refused")
    text = f"{message} (HTTP {status} {code})"
    if code == "integrity":
        return IntegrityError(text)
    if status == 429:
        return RateLimited(text, retry_after_s=retry_after_s or 1.0)
    default = WireError if 400 <= status < 500 else FlotillaError
    return _ERRORS.get(status, default)(text)


def _seconds(header: str | None) -> float | None:
    """A ``Retry-After`` of whole seconds (an HTTP date reads as unknown)."""
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None


class HttpDevice:
    """One device talking to one server over HTTP(S), a new connection per call (a broken
    one costs one call, never the session). Not thread-safe; one per device."""

    def __init__(
        self,
        server: str,
        credential: DeviceCredential | None = None,
        timeouts: Timeouts | None = None,
        tls_ca: Path | None = None,
        retries: int = 8,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``server``: ``http://HOST:PORT`` or ``https://...``, or several servers of one
        deployment separated by commas, tried in turn: after a call finds one unreachable
        (down, or sending the device to another server of the deployment), the next call
        goes to the next (``tls_ca``: the CA file to trust; ``tls_cert``/``tls_key``: this
        device's own certificate, for a server with mutual TLS); ``retries``: broken
        connections survived per transfer or call."""
        self._servers = [_address(s.strip()) for s in server.split(",") if s.strip()]
        if not self._servers:
            raise WireError("no server given: http://HOST:PORT or https://HOST:PORT")
        self._at = 0
        self._tls = ssl.create_default_context(cafile=str(tls_ca) if tls_ca else None)
        if tls_cert is not None:
            self._tls.load_cert_chain(tls_cert, tls_key)
        self.credential = credential
        #: The key uploads are signed with (``core.identity``): made at enrolment, or the
        #: saved one set by whoever restored the credential.
        self.identity: DeviceIdentity | None = None
        self.timeouts = timeouts or Timeouts()
        self._retries = retries
        self._rng = rng or random.Random()
        self._sleep = sleep
        #: Calls whose connection failed, since this object was made.
        self.broken_calls = 0

    # --- one call ------------------------------------------------------------------------

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        scheme, host, port = self._servers[self._at]
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=timeout_s, context=self._tls)
        return http.client.HTTPConnection(host, port, timeout=timeout_s)

    def _next_server(self) -> None:
        self._at = (self._at + 1) % len(self._servers)

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Flotilla-Protocol": str(PROTOCOL), "Accept": "application/json"}
        if self.credential is not None:
            c = self.credential
            headers["Authorization"] = f"Bearer {c.device_id}:{c.secret}"
        headers.update(extra or {})
        return headers

    def _call(
        self,
        method: str,
        path: str,
        timeout_s: float,
        body: Any = None,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> _Answer:
        """One request, JSON in and out; Unreachable when the connection fails."""
        extra = dict(headers or {})
        if body is not None:
            data = json.dumps(body, allow_nan=False).encode()
            extra["Content-Type"] = "application/json"
        conn = self._connection(timeout_s)
        try:
            conn.request(method, PREFIX + path, body=data, headers=self._headers(extra))
            response = conn.getresponse()
            raw = response.read()
            answer = _Answer(
                response.status, _json(raw), _seconds(response.getheader("Retry-After"))
            )
        except (OSError, http.client.HTTPException) as exc:
            self.broken_calls += 1
            self._next_server()
            raise Unreachable(f"{method} {PREFIX}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        if answer.status >= 400:
            error = error_for(answer.status, answer.body, answer.retry_after_s)
            if type(error) is Unreachable:  # 503: busy, or sent on to another server
                self._next_server()
            raise error
        return answer

    def _retrying(self, what: Callable[[], _Answer]) -> _Answer:
        """An idempotent call, retried after broken connections with jittered backoff."""
        for attempt in range(self._retries + 1):
            try:
                return what()
            except RateLimited as exc:  # the server said how long: no sooner
                if attempt == self._retries:
                    raise
                self._sleep(min(60.0, exc.retry_after_s) * (1.0 + 0.2 * self._rng.random()))
            except Unreachable:
                if attempt == self._retries:
                    raise
                self._backoff(attempt)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> None:
        self._sleep(min(5.0, 0.05 * 2**attempt) * (0.5 + self._rng.random()))

    # --- enrolment and work --------------------------------------------------------------

    def enrol(
        self, token: str, profile: DeviceProfile, identity: DeviceIdentity | None = None
    ) -> DeviceCredential:
        """A new device id and credential (kept on this object, with the key registered:
        ``identity``, or a new one); AuthError: token refused."""
        key = identity or DeviceIdentity.generate()
        body = {"protocol": PROTOCOL, "token": token, "profile": profile_json(profile),
                "public_key": key.public_key_hex}  # fmt: skip
        answer = self._call("POST", "/enrol", self.timeouts.enrol_s, body)
        self.identity = key
        self.credential = DeviceCredential(
            _field(answer.body, "device_id", str), _field(answer.body, "credential", str)
        )
        return self.credential

    def poll(
        self, conditions: DeviceConditions | None = None, profile: DeviceProfile | None = None
    ) -> OfferedTask | None:
        """The next task, after the server's hold (a long poll); None when there is none."""
        body: dict[str, Any] = {}
        if conditions is not None:
            body["conditions"] = conditions.to_dict()
        if profile is not None:
            body["profile"] = profile_json(profile)
        answer = self._call("POST", "/poll", self.timeouts.poll_s, body)
        task = answer.body.get("task") if isinstance(answer.body, dict) else None
        return None if task is None else offered_task(task)

    def heartbeat(self, round_token: str, conditions: DeviceConditions | None = None) -> bool:
        """Alive while training; whether the round is still open."""
        body: dict[str, Any] = {"round_token": round_token}
        if conditions is not None:
            body["conditions"] = conditions.to_dict()
        answer = self._retrying(
            lambda: self._call("POST", "/heartbeat", self.timeouts.heartbeat_s, body)
        )
        return bool(_field(answer.body, "round_open", bool))

    def report_failure(self, ref: RoundRef, reason: str) -> None:
        """Give up the round (conditions changed, training failed): a dropout, at once."""
        body = {"job_id": ref.job_id, "round": ref.round, "round_token": ref.round_token}
        self._call("POST", "/failure", self.timeouts.heartbeat_s, {**body, "reason": reason})

    def leave(self, reason: str = "") -> None:
        self._call("POST", "/leave", self.timeouts.leave_s, {"reason": reason})

    def secagg(self, ref: RoundRef, stage: int, body: bytes, timeout_s: float) -> bytes:
        """This device's message for one stage of a secure round; its message for the next
        stage once the stage closes on the server (b"" after the last). Not retried: a
        stage message is taken once."""
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept": "application/octet-stream",
            ROUND_TOKEN_HEADER: ref.round_token,
        }
        path = f"{PREFIX}/secagg/{urllib.parse.quote(ref.job_id, safe='')}/{ref.round}/{stage}"
        conn = self._connection(timeout_s)
        try:
            conn.request("POST", path, body=body, headers=self._headers(headers))
            response = conn.getresponse()
            raw = response.read(MAX_SECAGG_REPLY_BYTES + 1)
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            self.broken_calls += 1
            raise Unreachable(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        if status >= 400:
            raise error_for(status, _json(raw))
        if len(raw) > MAX_SECAGG_REPLY_BYTES:
            raise WireError(f"a secure-round reply is at most {MAX_SECAGG_REPLY_BYTES} bytes")
        return raw

    # --- model download ------------------------------------------------------------------

    def download_model(self, order: WorkOrder, dest: Path) -> DownloadReceipt:
        """The round's model at ``dest``, resuming ``dest.part`` if an earlier try left one;
        IntegrityError if the whole does not hash to ``order.model_sha256``."""
        sha, size = order.model_sha256, order.model_size
        part = dest.with_name(dest.name + ".part")
        resumed: list[int] = []
        deadline = time.monotonic() + self.timeouts.transfer_s
        for attempt in range(self._retries + 1):
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()
                have = 0
            if have and have < size:
                resumed.append(have)
            try:
                if have < size:
                    self._fetch_from(sha, part, have, size)
                break
            except Unreachable:
                if attempt == self._retries or time.monotonic() > deadline:
                    raise
                self._backoff(attempt)
        if _file_sha256(part) != sha:
            part.unlink()
            raise IntegrityError(f"the downloaded model does not hash to {sha}; fetch it again")
        os.replace(part, dest)
        return DownloadReceipt(dest, sha, size, tuple(resumed))

    def _fetch_from(self, sha: str, part: Path, have: int, size: int) -> None:
        """Append the bytes from ``have`` on to ``part``; what arrives before a break stays."""
        extra = {"Accept": "application/octet-stream"}
        if have:
            extra.update({"Range": f"bytes={have}-", "If-Range": f'"{sha}"'})
        conn = self._connection(self.timeouts.upload_idle_s)
        try:
            conn.request("GET", f"{PREFIX}/models/{sha}", headers=self._headers(extra))
            response = conn.getresponse()
            if response.status >= 400:
                raise error_for(response.status, _json(response.read()))
            with part.open("r+b" if part.exists() and response.status == 206 else "wb") as out:
                out.seek(have if response.status == 206 else 0)
                while block := response.read(READ_BYTES):
                    out.write(block)
                    if out.tell() > size:
                        raise WireError(f"the server sent more than the model's {size} bytes")
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"model download broke: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        if part.stat().st_size < size:
            raise Unreachable("model download ended early")

    # --- upload --------------------------------------------------------------------------

    def upload(
        self,
        order: WorkOrder,
        payload: bytes,
        num_samples: int,
        codec: str = "",
        metrics: Mapping[str, float] | None = None,
        chunk_bytes: int | None = None,
    ) -> UploadReceipt:
        """Send an update and wait for the verdict. After a broken connection the server is
        asked which ranges it holds and only the rest is sent; UpdateRejected (or a
        subclass) when the round refused it."""
        digest = hashlib.sha256(payload).digest()
        body: dict[str, Any] = {
            "job_id": order.job_id,
            "round": order.round,
            "round_token": order.round_token,
            "size": len(payload),
            "sha256": digest.hex(),
            "codec": codec,
            "num_samples": num_samples,
            "metrics": dict(metrics or {}),
        }
        if self.identity is not None:  # signed on the create call: docs/protocol.md
            signed = self.identity.sign_update(order.job_id, order.round, order.round_token, digest)
            body.update(nonce=signed.nonce.hex(), signature=signed.signature.hex())
        broken_before = self.broken_calls
        created = self._retrying(
            lambda: self._call("POST", "/uploads", self.timeouts.transfer_s, body)
        ).body
        upload_id = _field(created, "upload_id", str)
        step = min(chunk_bytes or _field(created, "chunk_bytes", int), created["max_chunk_bytes"])
        state = _Sending(upload_id, payload, max(1, step), _spans(created["missing"]))
        deadline = time.monotonic() + self.timeouts.transfer_s
        while True:
            try:
                if state.ask:
                    settled = self._resume_point(state)
                    if settled is not None:
                        verdict = settled
                        break
                verdict = self._send_rest(state)
                break
            except Unreachable:
                state.resumes += 1
                if state.resumes > self._retries or time.monotonic() > deadline:
                    raise
                self._backoff(state.resumes - 1)
                state.ask = True
        broken = self.broken_calls - broken_before
        return UploadReceipt(upload_id, True, verdict, state.sent, broken)

    def _send_rest(self, state: _Sending) -> str:
        for start, end in list(state.missing):
            for at in range(start, end, state.step):
                piece = state.payload[at : min(at + state.step, end)]
                headers = {
                    "Content-Type": "application/octet-stream",
                    "Content-Range": f"bytes {at}-{at + len(piece) - 1}/{len(state.payload)}",
                }
                path = f"/uploads/{state.upload_id}"
                self._call("PUT", path, self.timeouts.upload_idle_s, data=piece, headers=headers)
                state.sent += len(piece)
        state.missing = []
        path = f"/uploads/{state.upload_id}/finalize"
        answer = self._call("POST", path, self.timeouts.transfer_s, {})
        return str(answer.body.get("upload", {}).get("detail", "accepted"))

    def _resume_point(self, state: _Sending) -> str | None:
        """Ask the server what it lacks (after a broken call): the verdict if the upload
        was settled meanwhile (accepted: its detail; refused: raised), else None."""
        status = self.upload_status(state.upload_id)
        settled = status.get("state")
        if settled == "accepted":
            return str(status.get("detail", "accepted"))
        if settled == "refused":
            raise UpdateRejected(f"upload {state.upload_id} refused: {status.get('detail', '')}")
        if settled == "finalizing":
            raise Unreachable(f"upload {state.upload_id} is being finalized; ask again")
        state.missing = _spans(status["missing"])
        state.ask = False
        return None

    def upload_status(self, upload_id: str) -> dict[str, Any]:
        """The server's view of an upload: ``state``, ``received`` and ``missing`` ranges."""
        answer = self._retrying(
            lambda: self._call("GET", f"/uploads/{upload_id}", self.timeouts.heartbeat_s)
        )
        return dict(answer.body)


@dataclass(slots=True)
class _Sending:
    upload_id: str
    payload: bytes
    step: int
    #: Half-open ranges still to send; empty once every chunk went.
    missing: list[tuple[int, int]]
    sent: int = 0
    resumes: int = 0
    #: Whether to ask the server what it holds before sending more (after a break).
    ask: bool = False


def _address(server: str) -> tuple[str, str, int]:
    url = urllib.parse.urlsplit(server)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise WireError(f"server must be http://HOST:PORT or https://HOST:PORT, got {server!r}")
    return url.scheme, url.hostname, url.port or (443 if url.scheme == "https" else 80)


def profile_json(profile: DeviceProfile) -> dict[str, Any]:
    return {
        "tasks": list(profile.tasks),
        "gflops": profile.gflops,
        "memory_bytes": profile.memory_bytes,
        "upload_bytes_per_s": profile.upload_bytes_per_s,
        "device_class": profile.device_class,
        "samples": dict(profile.samples),
    }


def offered_task(task: Any) -> OfferedTask:
    """A poll answer's ``task`` object, checked field by field."""
    order = WorkOrder(
        job_id=_field(task, "job_id", str),
        round=_field(task, "round", int),
        round_token=_field(task, "round_token", str),
        task=_field(task, "task", str),
        config_json=json.dumps(_field(task, "config", dict)),
        model_sha256=_field(task, "model_sha256", str),
        model_size=_field(task, "model_size", int),
        deadline=float(_field(task, "deadline", (int, float))),
        seed=_field(task, "seed", int),
        delta_base_sha256=_field(task, "delta_base_sha256", str),
        delta_sha256=_field(task, "delta_sha256", str),
        delta_size=_field(task, "delta_size", int),
        uplink_codec=_field(task, "uplink_codec", str),
    )
    return OfferedTask(order, _field(task, "transport", str), _field(task, "max_upload_bytes", int))


def _field(obj: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(obj, dict) or not isinstance(obj.get(name), kind):
        raise WireError(f"the server's answer lacks a valid '{name}'")
    return obj[name]


def _spans(inclusive: Any) -> list[tuple[int, int]]:
    """``[[first, last], ...]`` (inclusive, as the wire writes them) as half-open spans."""
    if not isinstance(inclusive, list):
        raise WireError("the server's answer lacks its byte ranges")
    return [(int(a), int(b) + 1) for a, b in inclusive]


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"error": {"code": "", "message": raw[:200].decode("utf-8", "replace")}}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(READ_BYTES):
            digest.update(block)
    return digest.hexdigest()
