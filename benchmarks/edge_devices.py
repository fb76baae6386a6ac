"""Light simulated devices for ``benchmarks/edge.py``: many per process, one asyncio task each.

Both fleets speak their edge's wire protocol directly -- the HTTP device protocol
(``docs/protocol.md``) through one aiohttp session, the gRPC ``Agent`` service through one
grpc.aio channel per device (a local subchannel pool, so one TCP connection each, as
separate phones would have) -- and do nothing else: no training, no files, no speed test.
What a device does per call is what the real clients do (``flotilla.mobile.lite.http``,
``flotilla.client.grpc_transport``) minus the retries and the checks of what comes back,
so the measured cost is the server's. That includes identity (``docs/identity.md``): each
device makes an Ed25519 key at enrolment and registers its public key, and signs every
upload (a fresh nonce each) -- the server refuses an update without it, and its signature
check is part of its CPU per update.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import grpc

from flotilla.client.channel import credential_metadata
from flotilla.client.grpc_transport import header_to_pb, profile_to_pb
from flotilla.core.blobs import CHUNK_BYTES, sha256_hex
from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import DeviceProfile
from flotilla.core.identity import DeviceIdentity, UpdateSignature, digest_bytes
from flotilla.core.tensors import decode_state, encode_state
from flotilla.core.work import DeviceCredential, RoundRef, UploadHeader
from flotilla.proto import PROTOCOL_VERSION, bulk
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc
from flotilla.proto.conditions import conditions_to_pb

#: What every device reports at every poll: the state a job's [eligibility] would ask for.
CONDITIONS = DeviceConditions(charging=True, battery=0.9, network="unmetered", idle=True)
CONDITIONS_JSON = {"charging": True, "battery": 0.9, "network": "unmetered", "idle": True}
#: Deadline slack over the poll hold, and for every other call.
SLACK_S = 30.0


@dataclass(frozen=True, slots=True)
class Offer:
    """The part of a task a device without a trainer needs."""

    ref: RoundRef
    model_sha256: str
    model_url: str


class SharedUpdate:
    """One update for every device and round: small deltas in the model's layout, built from
    the first model downloaded (numpy only)."""

    def __init__(self) -> None:
        self.payload = b""
        self.sha256 = ""

    def of(self, model: bytes) -> bytes:
        if not self.payload:
            state = decode_state(model)
            self.payload = encode_state({k: v * 0 + 1e-4 for k, v in state.items()})
            self.sha256 = sha256_hex(self.payload)
        return self.payload


def sign(identity: DeviceIdentity, ref: RoundRef, sha256: str) -> UpdateSignature:
    """What a real device sends with each upload: a fresh nonce and its signature."""
    return identity.sign_update(ref.job_id, ref.round, ref.round_token, digest_bytes(sha256))


class Fleet(Protocol):
    """What ``benchmarks/edge.py`` asks of the devices of one edge."""

    edge: str

    async def enrol(self, token: str, profile: DeviceProfile) -> DeviceCredential: ...
    async def poll(self, device: DeviceCredential) -> Offer | None: ...
    async def fetch(self, device: DeviceCredential, offer: Offer) -> bytes: ...
    async def upload(
        self, device: DeviceCredential, offer: Offer, update: bytes, sha256: str, chunk: int
    ) -> None:
        """Upload ``update`` in chunks of ``chunk`` bytes (0: the edge's own size)."""

    async def leave(self, device: DeviceCredential) -> None: ...
    async def aclose(self) -> None: ...


class HttpFleet:
    """Devices on ``/device/v1/``: one aiohttp session, a connection per device in flight."""

    edge = "http"

    def __init__(self, base: str, hold_s: float) -> None:
        self._base = base.rstrip("/")
        self._api = self._base + "/device/v1"
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=SLACK_S + hold_s),
        )
        #: Each enrolled device's key, by device id: its uploads are signed with it.
        self._keys: dict[str, DeviceIdentity] = {}

    @staticmethod
    def _auth(device: DeviceCredential) -> dict[str, str]:
        return {"Authorization": f"Bearer {device.device_id}:{device.secret}"}

    async def _json(self, path: str, device: DeviceCredential | None, body: Any) -> Any:
        headers = self._auth(device) if device is not None else {}
        async with self._http.post(self._api + path, json=body, headers=headers) as r:
            answer = await r.json()
            if r.status >= 300:
                raise RuntimeError(f"POST {path}: {r.status} {answer}")
            return answer

    async def enrol(self, token: str, profile: DeviceProfile) -> DeviceCredential:
        key = DeviceIdentity.generate()
        body = {"protocol": 1, "token": token, "profile": {"tasks": list(profile.tasks)},
                "public_key": key.public_key_hex}  # fmt: skip
        got = await self._json("/enrol", None, body)
        self._keys[got["device_id"]] = key
        return DeviceCredential(got["device_id"], got["credential"])

    async def poll(self, device: DeviceCredential) -> Offer | None:
        task = (await self._json("/poll", device, {"conditions": CONDITIONS_JSON}))["task"]
        if task is None:
            return None
        ref = RoundRef(task["job_id"], task["round"], task["round_token"])
        return Offer(ref, task["model_sha256"], task["model_url"])

    async def fetch(self, device: DeviceCredential, offer: Offer) -> bytes:
        async with self._http.get(self._base + offer.model_url, headers=self._auth(device)) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {offer.model_url}: {r.status} {await r.text()}")
            return await r.read()

    async def upload(
        self, device: DeviceCredential, offer: Offer, update: bytes, sha256: str, chunk: int
    ) -> None:
        """Create (signed), the chunks in order, finalize: the protocol's resumable upload,
        unbroken."""
        ref, size = offer.ref, len(update)
        signed = sign(self._keys[device.device_id], ref, sha256)
        body = {
            **{"job_id": ref.job_id, "round": ref.round, "round_token": ref.round_token},
            **{"size": size, "sha256": sha256, "num_samples": 8, "metrics": {"loss": 1.0}},
            **{"nonce": signed.nonce.hex(), "signature": signed.signature.hex()},
        }
        upload = await self._json("/uploads", device, body)
        url = f"{self._api}/uploads/{upload['upload_id']}"
        chunk = chunk or int(upload["chunk_bytes"])
        for start in range(0, size, chunk):
            end = min(size, start + chunk)
            headers = {**self._auth(device), "Content-Range": f"bytes {start}-{end - 1}/{size}",
                       "Content-Type": "application/octet-stream"}  # fmt: skip
            async with self._http.put(url, data=update[start:end], headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"PUT chunk: {r.status} {await r.text()}")
                await r.read()
        done = await self._json(f"/uploads/{upload['upload_id']}/finalize", device, {})
        if not done.get("accepted"):
            raise RuntimeError(f"finalize: {done}")

    async def leave(self, device: DeviceCredential) -> None:
        await self._json("/leave", device, {"reason": "benchmark phase over"})

    async def aclose(self) -> None:
        await self._http.close()


@dataclass(frozen=True, slots=True)
class _Line:
    """One device's own connection to the gRPC edge."""

    channel: grpc.aio.Channel
    stub: pb_grpc.AgentStub
    fetch: Any
    submit: Any
    #: The device's key, registered at enrolment; its uploads are signed with it.
    identity: DeviceIdentity


class GrpcFleet:
    """Devices on the gRPC ``Agent`` service, each on its own channel (and TCP connection)."""

    edge = "grpc"

    def __init__(self, target: str, hold_s: float) -> None:
        self._target = target
        self._poll_s = hold_s + SLACK_S
        self._lines: dict[str, _Line] = {}

    def _open(self) -> _Line:
        options = [
            ("grpc.max_receive_message_length", 8 * 1024 * 1024),
            ("grpc.max_send_message_length", 8 * 1024 * 1024),
            ("grpc.enable_retries", 0),
            ("grpc.use_local_subchannel_pool", 1),  # a connection of its own
        ]
        channel = grpc.aio.insecure_channel(self._target, options=options)
        return _Line(
            channel,
            pb_grpc.AgentStub(channel),  # type: ignore[no-untyped-call]
            channel.unary_stream(
                "/flotilla.v1.Agent/FetchModel",
                request_serializer=pb.FetchModelRequest.SerializeToString,
                response_deserializer=bulk.read_blob_chunk,
            ),
            channel.stream_unary(
                "/flotilla.v1.Agent/SubmitUpdate",
                request_serializer=None,
                response_deserializer=pb.SubmitReply.FromString,
            ),
            DeviceIdentity.generate(),
        )

    async def enrol(self, token: str, profile: DeviceProfile) -> DeviceCredential:
        line = self._open()
        request = pb.EnrolRequest(
            protocol_version=PROTOCOL_VERSION,
            token=token,
            profile=profile_to_pb(profile),
            public_key=line.identity.public_key_hex,
        )
        got = await line.stub.Enrol(request, timeout=SLACK_S)
        self._lines[got.device_id] = line
        return DeviceCredential(got.device_id, got.credential)

    async def poll(self, device: DeviceCredential) -> Offer | None:
        line = self._lines[device.device_id]
        request = pb.PollRequest(conditions=conditions_to_pb(CONDITIONS))
        md = credential_metadata(device)
        reply = await line.stub.Poll(request, metadata=md, timeout=self._poll_s)
        if not reply.HasField("task"):
            return None
        t = reply.task
        return Offer(RoundRef(t.job_id, t.round, t.round_token), t.model_sha256, "")

    async def fetch(self, device: DeviceCredential, offer: Offer) -> bytes:
        line = self._lines[device.device_id]
        request = pb.FetchModelRequest(job_id=offer.ref.job_id, sha256=offer.model_sha256)
        call = line.fetch(request, metadata=credential_metadata(device), timeout=SLACK_S)
        return b"".join([bytes(piece.data) async for piece in call])

    async def upload(
        self, device: DeviceCredential, offer: Offer, update: bytes, sha256: str, chunk: int
    ) -> None:
        """ReserveUpload, then SubmitUpdate: the signed header and the bytes in chunks, one
        stream."""
        line, md = self._lines[device.device_id], credential_metadata(device)
        ref = offer.ref
        reserve = pb.ReserveUploadRequest(
            job_id=ref.job_id, round=ref.round, round_token=ref.round_token,
            payload_size=len(update),
        )  # fmt: skip
        room = await line.stub.ReserveUpload(reserve, metadata=md, timeout=SLACK_S)
        signed = sign(line.identity, ref, sha256)
        header = UploadHeader(
            ref, 8, len(update), sha256, "", {"loss": 1.0}, room.reservation,
            nonce=signed.nonce, signature=signed.signature,
        )  # fmt: skip
        chunk = chunk or CHUNK_BYTES
        frames = [bulk.update_header(header_to_pb(header))]
        frames += [bulk.update_data(update[i : i + chunk]) for i in range(0, len(update), chunk)]
        done = await line.submit(iter(frames), metadata=md, timeout=SLACK_S)
        if not done.accepted:
            raise RuntimeError(f"SubmitUpdate: {done.detail}")

    async def leave(self, device: DeviceCredential) -> None:
        line = self._lines[device.device_id]
        request = pb.LeaveRequest(reason="benchmark phase over")
        await line.stub.Leave(request, metadata=credential_metadata(device), timeout=SLACK_S)

    async def aclose(self) -> None:
        lines, self._lines = list(self._lines.values()), {}
        await asyncio.gather(*(line.channel.close(None) for line in lines))


__all__ = ["CONDITIONS", "Fleet", "GrpcFleet", "HttpFleet", "Offer", "SharedUpdate"]
