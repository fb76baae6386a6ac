"""A real agent process that dies by SIGKILL halfway through uploading its update.

Usage: python tests/support/half_upload_agent.py HOST:PORT ENROL_TOKEN TASK
Prints its device id, then kills itself mid-stream. Used to prove a partial upload
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc

from flotilla.core.blobs import BlobAssembler, sha256_hex
from flotilla.core.identity import DeviceIdentity, digest_bytes
from flotilla.core.tensors import decode_state, encode_state
from flotilla.proto import PROTOCOL_VERSION
from flotilla.proto import flotilla_pb2 as pb
from flotilla.proto import flotilla_pb2_grpc as pb_grpc


async def main(target: str, token: str, task_name: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.AgentStub(channel)
        profile = pb.DeviceProfile(tasks=[task_name])
        identity = DeviceIdentity.generate()  # signed like a real agent's: the server reads on
        enrol = await stub.Enrol(
            pb.EnrolRequest(
                protocol_version=PROTOCOL_VERSION, token=token, profile=profile,
                public_key=identity.public_key_hex,
            ),
            timeout=10,
        )  # fmt: skip
        md = (
            ("x-flotilla-device", enrol.device_id),
            ("authorization", f"Bearer {enrol.credential}"),
        )
        print(enrol.device_id, flush=True)
        task = None
        for _ in range(60):
            reply = await stub.Poll(pb.PollRequest(profile=profile), metadata=md, timeout=30)
            if reply.HasField("task"):
                task = reply.task
                break
        if task is None:
            sys.exit("never selected")
        assembler = BlobAssembler(task.model_size, task.model_sha256, 2**30)
        async for chunk in stub.FetchModel(
            pb.FetchModelRequest(job_id=task.job_id, sha256=task.model_sha256),
            metadata=md,
            timeout=30,
        ):
            assembler.add(chunk.data, chunk.offset)
        model = decode_state(bytes(assembler.finish()))
        payload = encode_state({k: v * 0 for k, v in model.items()})
        signed = identity.sign_update(
            task.job_id, task.round, task.round_token, digest_bytes(sha256_hex(payload))
        )
        header = pb.UpdateHeader(
            job_id=task.job_id,
            round=task.round,
            round_token=task.round_token,
            num_samples=10,
            payload_size=len(payload),
            payload_sha256=sha256_hex(payload),
            codec="safetensors",
            nonce=signed.nonce,
            signature=signed.signature,
        )
        sent = asyncio.Event()

        async def chunks():  # type: ignore[no-untyped-def]
            yield pb.UpdateChunk(header=header)
            yield pb.UpdateChunk(data=payload[: len(payload) // 2])
            sent.set()
            await asyncio.sleep(3600)

        call = stub.SubmitUpdate(chunks(), metadata=md, timeout=60)
        waiter = asyncio.ensure_future(call)
        half_sent = asyncio.ensure_future(sent.wait())
        await asyncio.wait({waiter, half_sent}, return_when=asyncio.FIRST_COMPLETED)
        if not sent.is_set():  # the server answered before taking the half: say why, not hang
            sys.exit(f"the server ended the upload before its half: {waiter.exception()!r}")
        await asyncio.sleep(0.5)  # let the half reach the server
        os.kill(os.getpid(), signal.SIGKILL)
        await waiter


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
