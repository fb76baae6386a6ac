"""The agent's requests over the HTTP device protocol (docs/protocol.md), on aiohttp.

``flotilla-lite``'s client (``mobile.lite.http``) is the protocol's reference: standard
library, blocking, a new connection per call, one device per thread. A load generator
needs hundreds of devices per process, so this transport speaks the same protocol on one
event loop through a shared aiohttp session (pooled keep-alive connections, as a fleet of
phones behind one carrier NAT would look). It parses answers with the reference client's
functions, so both read the wire the same way.

It carries the requests a device that uploads updates makes: enrol, poll, heartbeat,
model download, upload (create with the signature, one ``PUT`` per chunk, finalize),
failure and leave. A ``ReserveUpload`` makes no call: over HTTP the create call reserves
room (docs/protocol.md, "Uploads"). Server-less and secure rounds are not in its scope.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar, cast

import aiohttp

from flotilla.client.transport import (
    Buffer,
    Enrol,
    FetchModel,
    GiveUp,
    Heartbeat,
    Leave,
    Poll,
    Receipt,
    Request,
    ReserveUpload,
    SubmitUpdate,
    closed_set,
)
from flotilla.core.errors import FlotillaError, Unreachable, WireError
from flotilla.core.work import DeviceCredential, Reservation
from flotilla.mobile.lite.http import (
    PREFIX,
    PROTOCOL,
    READ_BYTES,
    error_for,
    offered_task,
    profile_json,
)

R = TypeVar("R")


class HttpTransport:
    """An :class:`~flotilla.client.transport.AgentTransport` to ``http://HOST:PORT``, or to
    several servers of one deployment (comma-separated): calls go to one at a time, and to
    the next after one finds it unreachable (as the agent's gRPC transport does).

    ``session`` is shared by the devices of one process (its connector bounds the
    connections); the transport never closes it.
    """

    def __init__(self, base_url: str, session: aiohttp.ClientSession) -> None:
        self._bases = [u.strip().rstrip("/") + PREFIX for u in base_url.split(",") if u.strip()]
        self._at = 0
        self._session = session

    @property
    def _base(self) -> str:
        return self._bases[self._at]

    async def send(self, request: Request[R]) -> R:
        r = closed_set(request)
        try:
            try:
                reply = await asyncio.wait_for(self._dispatch(r), r.timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise Unreachable(f"{type(r).__name__}: {type(exc).__name__}: {exc}") from exc
        except Unreachable as exc:
            if type(exc) is Unreachable:
                self._at = (self._at + 1) % len(self._bases)
            raise
        return cast(R, reply)

    async def aclose(self) -> None:
        """Nothing of its own to release: the session belongs to the caller."""

    async def _dispatch(self, r: object) -> object:
        match r:
            case Enrol():
                body = {"protocol": PROTOCOL, "token": r.token,
                        "profile": profile_json(r.profile), "public_key": r.public_key}  # fmt: skip
                got = await self._json("POST", "/enrol", None, body)
                return DeviceCredential(_str(got, "device_id"), _str(got, "credential"))
            case Poll():
                poll: dict[str, Any] = {}
                if r.conditions is not None:
                    poll["conditions"] = r.conditions.to_dict()
                if r.profile is not None:
                    poll["profile"] = profile_json(r.profile)
                got = await self._json("POST", "/poll", r.credential, poll)
                task = got.get("task")
                return None if task is None else offered_task(task).order
            case Heartbeat():
                beat: dict[str, Any] = {"round_token": r.round_token}
                if r.conditions is not None:
                    beat["conditions"] = r.conditions.to_dict()
                got = await self._json("POST", "/heartbeat", r.credential, beat)
                return bool(got.get("round_open", False))
            case FetchModel():
                return self._download(r.credential, r.sha256)
            case ReserveUpload():
                return Reservation("", r.timeout_s)
            case SubmitUpdate():
                return await self._upload(r)
            case GiveUp():
                ref = r.ref
                failure = {"job_id": ref.job_id, "round": ref.round,
                           "round_token": ref.round_token, "reason": r.reason}  # fmt: skip
                await self._json("POST", "/failure", r.credential, failure)
                return None
            case Leave():
                await self._json("POST", "/leave", r.credential, {"reason": r.reason})
                return None
        raise TypeError(f"{type(r).__name__} has no call in the HTTP load transport")

    def _headers(self, me: DeviceCredential | None) -> dict[str, str]:
        headers = {"Flotilla-Protocol": str(PROTOCOL), "Accept": "application/json"}
        if me is not None:
            headers["Authorization"] = f"Bearer {me.device_id}:{me.secret}"
        return headers

    async def _json(
        self,
        method: str,
        path: str,
        me: DeviceCredential | None,
        body: Any = None,
        data: Buffer | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        all_headers = {**self._headers(me), **(headers or {})}
        if body is not None:
            data = json.dumps(body, allow_nan=False).encode()
            all_headers["Content-Type"] = "application/json"
        async with self._session.request(
            method, self._base + path, data=data, headers=all_headers
        ) as response:
            raw = await response.read()
            answer = _parse(raw)
            if response.status >= 400:
                raise error_for(response.status, answer, _retry_after(response))
        if not isinstance(answer, dict):
            raise WireError(f"{method} {path}: the answer is not a JSON object")
        return answer

    async def _download(self, me: DeviceCredential, sha256: str) -> AsyncIterator[Buffer]:
        url = f"{self._base}/models/{sha256}"
        try:
            async with self._session.get(url, headers=self._headers(me)) as response:
                if response.status >= 400:
                    raise error_for(response.status, _parse(await response.read()))
                async for piece in response.content.iter_chunked(READ_BYTES):
                    yield piece
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"GET model: {type(exc).__name__}: {exc}") from exc

    async def _upload(self, r: SubmitUpdate) -> Receipt:
        """Create (size, SHA-256, signature), one ``PUT`` per chunk, finalize."""
        h = r.header
        create: dict[str, Any] = {
            "job_id": h.ref.job_id, "round": h.ref.round, "round_token": h.ref.round_token,
            "size": h.payload_size, "sha256": h.payload_sha256, "codec": h.codec,
            "num_samples": h.num_samples, "metrics": dict(h.metrics),
            "nonce": h.nonce.hex(), "signature": h.signature.hex(),
        }  # fmt: skip
        me = r.credential
        created = await self._json("POST", "/uploads", me, create)
        upload = f"/uploads/{_str(created, 'upload_id')}"
        at = 0
        async for chunk in r.chunks:
            end = at + len(chunk) - 1
            headers = {"Content-Type": "application/octet-stream",
                       "Content-Range": f"bytes {at}-{end}/{h.payload_size}"}  # fmt: skip
            await self._json("PUT", upload, me, data=chunk, headers=headers)
            at = end + 1
        if at != h.payload_size:
            raise FlotillaError(f"sent {at} of the {h.payload_size} bytes declared")
        done = await self._json("POST", f"{upload}/finalize", me, {})
        detail = done.get("upload", {})
        return Receipt(bool(done.get("accepted")), str(detail.get("detail", "")))


def _str(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise WireError(f"the server's answer lacks a valid '{name}'")
    return value


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"error": {"code": "", "message": raw[:200].decode("utf-8", "replace")}}


def _retry_after(response: aiohttp.ClientResponse) -> float | None:
    try:
        value = response.headers.get("Retry-After")
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None
