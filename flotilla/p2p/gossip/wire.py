"""Gossip shares over hivemind's libp2p: one stream per share, answered with the weight
the receiver took.

A share is a stream of hivemind ``DownloadData`` messages: the first carries a JSON header
(``{"version": 1, "step": int, "weight": float, "hold_s": float, "tensors": int}``;
``hold_s``: how long the receiver may hold the share for its step), the rest the tensors'
parts, each tensor serialized with the run's compression (flotilla's int8, fp16 or none)
and cut into chunks (a chunk with a dtype starts the next tensor). The answer is one
``DownloadData`` whose header is ``{"taken": float}``, with ``"error"`` when refused. A
stream larger than the receiver's model allows is refused as it arrives; every refusal
answers "nothing taken", so the sender takes its weight back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.averaging_pb2 import DownloadData
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from flotilla.core.errors import AnswerLost, FlotillaError, Unreachable, WireError
from flotilla.core.streams import paced
from flotilla.p2p.gossip.peer import GossipPeer
from flotilla.p2p.gossip.pushsum import GossipShare

log = logging.getLogger(__name__)

VERSION = 1
HEADER_FIELDS = frozenset({"version", "step", "weight", "hold_s", "tensors"})
#: Bytes of tensor data per stream message (libp2p's persistent connections carry 4 MiB).
CHUNK_BYTES = 2**20
#: Allowance per tensor over its raw float32 size: serialized headers, int8 scales.
TENSOR_OVERHEAD_BYTES = 4096


def handler_name(swarm: str) -> str:
    """The protocol a run's gossip shares travel on (hivemind's ``prefix::method`` style)."""
    return f"{swarm}::gossip_share"


def share_messages(
    share: GossipShare, compression: CompressionBase, hold_s: float
) -> list[DownloadData]:
    header = {"version": VERSION, "step": share.step, "weight": share.weight,
              "hold_s": hold_s, "tensors": len(share.tensors)}  # fmt: skip
    messages = [DownloadData(metadata=json.dumps(header).encode())]
    for tensor in share.tensors:
        flat = tensor.detach().float().contiguous()
        serialized = compression.compress(flat, CompressionInfo.from_tensor(flat))
        messages += [
            DownloadData(tensor_part=p) for p in split_for_streaming(serialized, CHUNK_BYTES)
        ]
    return messages


async def read_share(
    messages: AsyncIterator[DownloadData], shapes: Sequence[torch.Size], idle_s: float
) -> tuple[GossipShare, float]:
    """The share a stream carries, for a model of ``shapes``, and how long it may be held;
    WireError for a malformed header, a stream larger than such a model needs, tensors
    that do not decode, or a sender silent for ``idle_s`` mid-stream."""
    limit = sum(4 * math.prod(s) + TENSOR_OVERHEAD_BYTES for s in shapes) + 2**16

    stream = paced(messages, idle_s, "gossip share")
    first = await anext(stream, None)
    if first is None:
        raise WireError("an empty gossip stream")
    step, weight, hold_s, count = _header(first.metadata)
    if count != len(shapes):
        raise WireError(f"a share of {count} tensors for a model of {len(shapes)}")
    parts: list[list[Any]] = []
    received = len(first.metadata)
    async for message in stream:
        part = message.tensor_part
        received += len(part.buffer) + len(message.metadata)
        if received > limit:
            raise WireError(f"a gossip share over {limit} bytes, more than this model needs")
        if part.dtype or not parts:
            parts.append([])
        parts[-1].append(part)
    if len(parts) != count:
        raise WireError(f"a share announced {count} tensors and carried {len(parts)}")
    try:
        tensors = tuple(deserialize_torch_tensor(combine_from_streaming(p)) for p in parts)
    except Exception as exc:  # any decoder's failure on foreign bytes is the sender's fault
        raise WireError(f"a gossip share's tensors do not decode: {exc}") from None
    return GossipShare(step, weight, tensors), hold_s


def _header(raw: bytes) -> tuple[int, float, float, int]:
    try:
        header = json.loads(raw)
    except ValueError:
        raise WireError("a gossip share's header is not JSON") from None
    if not isinstance(header, dict) or set(header) != HEADER_FIELDS:
        raise WireError(
            f"a gossip share's header has the fields {', '.join(sorted(HEADER_FIELDS))}"
        )
    if header["version"] != VERSION:
        raise WireError(f"gossip share version {header['version']!r}; this peer speaks {VERSION}")
    step, weight, hold_s, count = (header[k] for k in ("step", "weight", "hold_s", "tensors"))
    if not (isinstance(step, int) and step >= 0 and isinstance(count, int) and count >= 0):
        raise WireError("a gossip share's step and tensor count are non-negative integers")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (weight, hold_s)):
        raise WireError("a gossip share's weight and hold_s are numbers")
    return step, float(weight), float(hold_s), count


def answer(taken: float, error: str = "") -> DownloadData:
    body: dict[str, Any] = {"taken": taken}
    if error:
        body["error"] = error
    return DownloadData(metadata=json.dumps(body).encode())


def taken_of(reply: DownloadData) -> float:
    """The weight an answer says was taken; Unreachable (nothing taken) when refused."""
    try:
        body = json.loads(reply.metadata)
        taken = float(body["taken"])
    except (ValueError, KeyError, TypeError):
        raise WireError("a gossip answer without a taken weight") from None
    if body.get("error"):
        raise Unreachable(f"share refused: {body['error']}")
    return taken if math.isfinite(taken) and taken > 0 else 0.0


class LibP2PTransport:
    """Sends shares to peers of the run and serves this peer's :class:`GossipPeer`, on a
    hivemind ``P2P`` (the DHT's, replicated into this process's loop)."""

    def __init__(
        self,
        p2p: P2P,
        swarm: str,
        compression: CompressionBase,
        shapes: Sequence[torch.Size],
        send_s: float,
    ) -> None:
        self._p2p, self._name = p2p, handler_name(swarm)
        self._compression, self._shapes, self._send_s = compression, tuple(shapes), send_s

    async def send(self, peer: str, share: GossipShare, hold_s: float) -> float:
        messages = await asyncio.to_thread(share_messages, share, self._compression, hold_s)

        async def stream() -> AsyncIterator[DownloadData]:
            for message in messages:
                yield message

        call = self._p2p.call_protobuf_handler(
            PeerID.from_base58(peer), self._name, stream(), DownloadData
        )
        try:
            reply = await asyncio.wait_for(call, self._send_s)
        except FlotillaError:
            raise
        except ValueError as exc:  # hivemind's asingle(): the stream ended with no answer
            raise AnswerLost(f"{peer} did not answer a gossip share: {exc}") from None
        except Exception as exc:  # timeouts, resets, a peer that left: not delivered
            raise Unreachable(f"{peer} did not take a gossip share: {exc!r}") from None
        return taken_of(reply)

    async def serve(self, peer: GossipPeer) -> None:
        """Answer this run's shares with ``peer`` (until the P2P shuts down).

        The handler yields its answer, so it learns whether hivemind could send it: it
        resumes after the answer went out, and is closed at the ``yield`` when the stream
        broke first (the sender hung up, the connection dropped); then the share it mixed
        is taken back out, since its sender takes its weight back too."""
        shapes = self._shapes

        async def handle(
            messages: AsyncIterator[DownloadData], context: P2PContext
        ) -> AsyncIterator[DownloadData]:
            sender = context.remote_id.to_base58()
            try:
                share, hold_s = await read_share(messages, shapes, self._send_s)
                taken = await peer.receive(sender, share, hold_s)
            except FlotillaError as exc:
                yield answer(0.0, str(exc) or type(exc).__name__)
                return
            except Exception as exc:  # a bug here must not look like a silent peer
                log.exception("a gossip share from %s failed", sender)
                yield answer(0.0, f"the receiver failed: {exc!r}")
                return
            # Written or not within the hold: a sender that waited longer has taken its
            # weight back, so the share comes back out here (once, whichever comes first).
            sent = undone = False

            def give_back() -> None:
                nonlocal undone
                if not (sent or undone):
                    undone = True
                    peer.untake(sender, share, taken)

            watchdog = asyncio.get_running_loop().call_later(max(hold_s, 1.0), give_back)
            try:
                yield answer(taken)
                sent = not undone
            finally:
                watchdog.cancel()
                give_back()

        await self._p2p.add_protobuf_handler(
            self._name, handle, DownloadData, stream_input=True, stream_output=True
        )
