"""The SecAgg+ parts on their own: Shamir (property tests), the PRG, bit packing,
quantization and the message formats."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flotilla.secagg import SecAggConfig
from flotilla.secagg import messages as msg
from flotilla.secagg.bits import pack, unpack
from flotilla.secagg.prg import expand
from flotilla.secagg.quantize import dequantize, quantize
from flotilla.secagg.shamir import PRIME, Share, interpolate, reconstruct, split

pytestmark = pytest.mark.timeout(120)

secrets_32 = st.binary(min_size=32, max_size=32)


@settings(max_examples=60, deadline=None)
@given(secret=secrets_32, k=st.integers(1, 20), data=st.data())
def test_any_t_shares_reconstruct(secret: bytes, k: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, k))
    shares = split(secret, t, list(range(1, k + 1)), random.Random(k).randbytes)
    chosen = data.draw(st.permutations(shares))[:t]
    assert reconstruct(chosen, t) == secret


@settings(max_examples=60, deadline=None)
@given(secret=secrets_32, k=st.integers(2, 20), data=st.data())
def test_t_minus_one_shares_give_a_wrong_secret(secret: bytes, k: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(2, k))
    shares = split(secret, t, list(range(1, k + 1)), random.Random(secret).randbytes)
    fewer = data.draw(st.permutations(shares))[: t - 1]
    with pytest.raises(ValueError, match="needed"):
        reconstruct(fewer, t)
    assert interpolate(fewer) != int.from_bytes(secret, "big")


@settings(max_examples=30, deadline=None)
@given(secret=secrets_32, k=st.integers(2, 10))
def test_duplicate_and_invalid_share_indices_are_refused(secret: bytes, k: int) -> None:
    shares = split(secret, 2, list(range(1, k + 1)), random.Random(0).randbytes)
    with pytest.raises(ValueError, match="repeated"):
        reconstruct([shares[0], shares[0]], 2)
    with pytest.raises(ValueError):
        Share(0, 1)
    with pytest.raises(ValueError):
        Share(1, PRIME)
    with pytest.raises(ValueError):
        split(secret, 2, [1, 1], random.Random(0).randbytes)


def test_prg_is_chacha20_at_full_key_length() -> None:
    a = expand(bytes(32), 1000, 62)
    assert a.dtype == np.uint64 and int(a.max()) < 2**62
    np.testing.assert_array_equal(a, expand(bytes(32), 1000, 62))
    other = expand(bytes(31) + b"\x01", 1000, 62)  # one bit of the key changes everything
    assert np.count_nonzero(a == other) == 0


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 64), n=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_bit_packing_round_trips(m: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    if m < 64:
        values &= np.uint64(2**m - 1)
    packed = pack(values, m)
    assert len(packed) == (n * m + 7) // 8
    np.testing.assert_array_equal(unpack(packed, n, m), values)


def test_stochastic_rounding_is_unbiased_and_clipped() -> None:
    config = SecAggConfig(2, 2, 1.0, 4, 40, 1.0)
    x = np.full(200_000, 0.123, dtype=np.float32)
    q = quantize(x, config, random.Random(1).randbytes)
    assert set(np.unique(q).tolist()) <= {8, 9}  # the two grid points around 0.123
    assert abs(float(dequantize(q, config).mean()) - 0.123) < 1e-3
    edges = quantize(np.array([-5.0, 5.0], dtype=np.float32), config, random.Random(2).randbytes)
    assert edges.tolist() == [0, 15]
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.array([np.nan], dtype=np.float32), config, random.Random(2).randbytes)


def test_messages_round_trip() -> None:
    share = Share(3, 12345)
    reveals = (
        msg.Reveal("a", msg.Secret.SELF_MASK, share),
        msg.Reveal("b", msg.Secret.MASK_KEY, share),
    )
    assert msg.decode_unmask(msg.encode_unmask(reveals)) == reveals
    lists = msg.SurvivorList(("a", "b"), ("c",))
    assert msg.decode_survivors(msg.encode_survivors(lists)) == lists
    sealed = (msg.Sealed("peer", b"x" * 157),)
    assert msg.decode_sealed(msg.encode_sealed(msg.Kind.SHARES, sealed), msg.Kind.SHARES) == sealed
    with pytest.raises(msg.SecAggMessageError, match="not a SHARE_LIST"):
        msg.decode_sealed(msg.encode_sealed(msg.Kind.SHARES, sealed), msg.Kind.SHARE_LIST)
    bundle = msg.ShareBundle(share, Share(4, PRIME - 1))
    assert msg.decode_bundle(msg.encode_bundle(bundle)) == bundle
    values = np.arange(10, dtype=np.uint64)
    body = msg.encode_masked_input(values, 36)
    np.testing.assert_array_equal(msg.decode_masked_input(body, 10, 36), values)
    with pytest.raises(msg.SecAggMessageError, match="another shape"):
        msg.decode_masked_input(body, 11, 36)


def test_a_huge_declared_count_is_refused_before_allocating() -> None:
    body = b"FSA\x01" + bytes([msg.Kind.SIGNATURES]) + b"\xff\xff" + b"\x00" * 10
    with pytest.raises(msg.SecAggMessageError, match="bad entry count"):
        msg.decode_signatures(body)
    with pytest.raises(msg.SecAggMessageError, match="oversized"):
        msg.decode_signatures(b"\x00" * (msg.MAX_CONTROL_BYTES + 1))
