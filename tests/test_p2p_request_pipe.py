"""The DHT worker's request pipe (``flotilla.p2p.dht.RequestPipe``): a request is read
whole even when its body comes after its length on a non-blocking pipe, and a request
that cannot be rebuilt becomes a no-op instead of ending the worker."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler

import pytest

from flotilla.p2p.dht import RequestPipe

pytestmark = pytest.mark.timeout(30)


def test_a_body_that_follows_its_length_later_is_read_whole() -> None:
    reader, writer = mp.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)  # as hivemind's worker may find it
    body = bytes(ForkingPickler.dumps(("store", ["key", b"x" * 40_000], {"ttl": 5})))

    def send() -> None:
        os.write(writer.fileno(), struct.pack("!i", len(body)))
        time.sleep(0.2)  # the sender writes the body a moment later
        view = memoryview(body)
        while view:
            view = view[os.write(writer.fileno(), view) :]

    sender = threading.Thread(target=send)
    sender.start()
    pipe = RequestPipe(reader)
    assert pipe.poll(5)
    method, args, kwargs = pipe.recv()
    sender.join(5)
    assert (method, args[0], len(args[1]), kwargs) == ("store", "key", 40_000, {"ttl": 5})
    assert not os.get_blocking(reader.fileno()), "the descriptor's mode is left as it was"


def test_a_request_that_cannot_be_rebuilt_is_skipped() -> None:
    reader, writer = mp.Pipe(duplex=False)
    writer.send_bytes(b"not a pickle")
    writer.send(("get", ["key"], {}))
    pipe = RequestPipe(reader)
    assert pipe.recv() == ("_skip", [], {})
    assert pipe.recv() == ("get", ["key"], {})
