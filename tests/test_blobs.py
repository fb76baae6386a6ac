"""Blobs in transit (BlobAssembler, iter_chunks) and at rest (the server's BlobStore)."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flotilla.core.blobs import BlobAssembler, iter_chunks, sha256_hex
from flotilla.core.blobstore import ABANDONED_WRITE_AGE_S, BlobStore
from flotilla.core.errors import IntegrityError, NotFoundError, WireError
from tests.support.lifetime import bound

# Seeded, not os.urandom: SHA names parametrized tests, and pytest-xdist needs every worker
# to collect the same test ids.
DATA = random.Random(13).randbytes(10_000)
SHA = hashlib.sha256(DATA).hexdigest()


# --- chunks and assembly ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 999, 1000, 4096, 10_000, 20_000])
def test_iter_chunks_covers_the_blob_in_order(size: int) -> None:
    chunks = list(iter_chunks(DATA, size))
    assert b"".join(chunks) == DATA
    assert all(0 < len(c) <= size for c in chunks)
    assert len(chunks) == -(-len(DATA) // size)


def test_iter_chunks_of_nothing_is_nothing() -> None:
    assert list(iter_chunks(b"", 10)) == []


def test_assembler_ok_path_with_offsets() -> None:
    asm = BlobAssembler(len(DATA), SHA, max_bytes=len(DATA))
    offset = 0
    for chunk in iter_chunks(DATA, 3000):
        asm.add(bytes(chunk), offset)
        offset += len(chunk)
    assert asm.received == len(DATA)
    assert bytes(asm.finish()) == DATA


def test_assembler_without_offsets_and_empty_blob() -> None:
    asm = BlobAssembler(len(DATA), SHA, max_bytes=1 << 20)
    for chunk in iter_chunks(DATA, 777):
        asm.add(bytes(chunk))
    assert asm.finish() == DATA
    assert BlobAssembler(0, sha256_hex(b""), max_bytes=0).finish() == b""


@pytest.mark.parametrize("declared", [2**50, 1001, -1])
def test_declared_size_over_the_limit_is_refused_before_allocating(declared: int) -> None:
    # 2**50 bytes could never be allocated: a WireError (not MemoryError) proves we did not try.
    with pytest.raises(WireError, match="exceeds the limit of 1000"):
        BlobAssembler(declared, SHA, max_bytes=1000)


def test_bad_digest_is_refused() -> None:
    with pytest.raises(WireError, match="64 hex"):
        BlobAssembler(10, "abc", max_bytes=100)


def test_stream_longer_than_declared_is_refused() -> None:
    asm = BlobAssembler(10, SHA, max_bytes=100)
    asm.add(b"x" * 8)
    with pytest.raises(WireError, match="longer than its declared 10 bytes"):
        asm.add(b"x" * 3)
    assert asm.received == 8


def test_truncated_stream_is_refused() -> None:
    asm = BlobAssembler(len(DATA), SHA, max_bytes=len(DATA))
    asm.add(DATA[:5000])
    with pytest.raises(WireError, match="truncated: 5000 of 10000"):
        asm.finish()


def test_wrong_content_is_an_integrity_error() -> None:
    asm = BlobAssembler(len(DATA), SHA, max_bytes=len(DATA))
    asm.add(DATA[:-1] + bytes([DATA[-1] ^ 1]))
    with pytest.raises(IntegrityError, match="sha256"):
        asm.finish()


@pytest.mark.parametrize("offset", [0, 1, 99, 101], ids=["replay", "1", "99", "101"])
def test_chunk_at_the_wrong_offset_is_refused(offset: int) -> None:
    asm = BlobAssembler(len(DATA), SHA, max_bytes=len(DATA))
    asm.add(DATA[:100], 0)
    with pytest.raises(WireError, match=f"offset {offset}, expected 100"):
        asm.add(DATA[100:200], offset)
    asm.add(DATA[100:], 100)  # the stream goes on from where it really is
    assert asm.finish() == DATA


# --- the store on disk ----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_put_get_is_content_addressed_and_idempotent(store: BlobStore) -> None:
    assert store.put(DATA) == SHA
    assert store.put(bytearray(DATA)) == SHA
    assert store.put(memoryview(DATA)) == SHA
    assert store.get(SHA) == DATA
    assert store.size(SHA) == len(DATA)
    assert _files(store.root) == [store.path(SHA)]


def test_put_leaves_no_temporary_files(store: BlobStore) -> None:
    shas = {store.put(os.urandom(n)) for n in (0, 1, 5000)}
    files = _files(store.root)
    assert sorted(files) == sorted(store.path(s) for s in shas)
    assert not [p for p in files if p.name.startswith(".tmp")]


def test_opening_the_store_removes_only_abandoned_writes(tmp_path: Path) -> None:
    """Servers of a deployment share one state directory: one that starts must not remove
    the others' writes in progress, only those a crash cut short."""
    root, host = tmp_path / "blobs", socket.gethostname()
    root.mkdir()
    alive = subprocess.Popen(bound([sys.executable, "-c", "import time; time.sleep(60)"]))
    dead = subprocess.Popen(bound([sys.executable, "-c", "pass"]))
    dead.wait(30)
    try:
        in_progress = root / f".tmp-{alive.pid}@{host}~abc"
        crashed = root / f".tmp-{dead.pid}@{host}~abc"
        elsewhere = root / ".tmp-1@another-host~abc"
        old_style, stale = root / ".tmp-k3j2l1", root / ".tmp-2@another-host~abc"
        for path in (in_progress, crashed, elsewhere, old_style, stale):
            path.write_bytes(b"partial")
        day_ago = time.time() - ABANDONED_WRITE_AGE_S - 60
        for path in (old_style, stale):
            os.utime(path, (day_ago, day_ago))
        BlobStore(root)
        assert sorted(p.name for p in root.iterdir()) == sorted(
            p.name for p in (in_progress, elsewhere)
        )
    finally:
        alive.kill()
        alive.wait(30)


def test_corrupt_file_on_disk_is_detected(store: BlobStore) -> None:
    store.put(DATA)
    path = store.path(SHA)
    path.write_bytes(DATA[:-1] + b"\0")
    with pytest.raises(IntegrityError, match="corrupt"):
        store.get(SHA)


def test_mapped_blobs_are_checked_once_per_process(store: BlobStore) -> None:
    store.put(DATA)
    assert bytes(store.get_mapped(SHA)) == DATA
    store.path(SHA).write_bytes(DATA[:-1] + b"\0")
    # A server that starts on a state dir (a new store) checks what it maps.
    with pytest.raises(IntegrityError, match="corrupt"):
        BlobStore(store.root).get_mapped(SHA)


def test_put_replaces_a_corrupt_copy(store: BlobStore) -> None:
    store.put(DATA)
    store.path(SHA).write_bytes(b"garbage")
    store.put(DATA)
    assert store.get(SHA) == DATA


def test_iter_chunks_streams_the_blob(store: BlobStore) -> None:
    store.put(DATA)
    chunks = store.iter_chunks(SHA, chunk_bytes=4096)
    first = next(chunks)
    assert first == DATA[:4096]
    rest = list(chunks)
    assert [len(c) for c in rest] == [4096, 10_000 - 8192]
    assert first + b"".join(rest) == DATA


def test_unknown_blob_is_not_found(store: BlobStore) -> None:
    missing = sha256_hex(b"never stored")
    with pytest.raises(NotFoundError):
        store.get(missing)
    with pytest.raises(NotFoundError):
        store.size(missing)
    with pytest.raises(NotFoundError):
        list(store.iter_chunks(missing))


@pytest.mark.parametrize(
    "name",
    ["../x", "../" + "a" * 61, "/etc/passwd", SHA.upper(), SHA[:-1], SHA + "0", "", "g" * 64],
)
def test_path_refuses_anything_but_a_digest(store: BlobStore, name: str) -> None:
    with pytest.raises(NotFoundError, match="not a sha256 digest"):
        store.path(name)
    with pytest.raises(NotFoundError):
        store.get(name)


def test_path_stays_under_the_root(store: BlobStore) -> None:
    path = store.path(SHA)
    assert path.resolve().is_relative_to(store.root.resolve())
    assert path.parent.name == SHA[:2]
