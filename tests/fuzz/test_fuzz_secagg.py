"""Fuzz every SecAgg+ message decoder with Hypothesis over raw bytes: random bytes, a valid
header with random bytes after it, and valid messages with bytes flipped, cut or inserted.
At least 10,000 inputs per decoder; the only exception allowed is SecAggMessageError.

A longer run: ``FLOTILLA_FUZZ_EXAMPLES=200000 pytest tests/fuzz/test_fuzz_secagg.py``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flotilla.secagg import SecAggMessageError
from flotilla.secagg import messages as msg
from flotilla.secagg.shamir import Share

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz"), pytest.mark.timeout(300)]

EXAMPLES = int(os.environ.get("FLOTILLA_FUZZ_EXAMPLES", "10000"))
_SHARE = Share(7, 2**500 + 3)
_KEY, _SIG = b"k" * 32, b"s" * 64

#: decoder name -> (decode, one valid message of that kind)
DECODERS: dict[str, tuple[Callable[[bytes], object], bytes]] = {
    "advertisement": (
        msg.decode_advertisement,
        msg.encode_advertisement(msg.Advertisement(_KEY, _KEY, _SIG)),
    ),
    "advert_list": (
        msg.decode_advert_list,
        msg.encode_advert_list(
            tuple(msg.AdvertEntry(f"d{i}", _KEY, _KEY, _KEY, _SIG) for i in range(3))
        ),
    ),
    "shares": (
        lambda b: msg.decode_sealed(b, msg.Kind.SHARES),
        msg.encode_sealed(msg.Kind.SHARES, (msg.Sealed("a", b"c" * 157), msg.Sealed("b", b""))),
    ),
    "share_list": (
        lambda b: msg.decode_sealed(b, msg.Kind.SHARE_LIST),
        msg.encode_sealed(msg.Kind.SHARE_LIST, (msg.Sealed("a", b"c" * 157),)),
    ),
    "masked_input": (
        lambda b: msg.decode_masked_input(b, 33, 37),
        msg.encode_masked_input(np.arange(33, dtype=np.uint64), 37),
    ),
    "masked_input_count": (
        msg.masked_input_count,
        msg.encode_masked_input(np.arange(33, dtype=np.uint64), 37),
    ),
    "survivors": (
        msg.decode_survivors,
        msg.encode_survivors(msg.SurvivorList(("a", "b", "c"), ("d",))),
    ),
    "signature": (msg.decode_signature, msg.encode_signature(_SIG)),
    "signatures": (msg.decode_signatures, msg.encode_signatures((("a", _SIG), ("b", _SIG)))),
    "unmask": (
        msg.decode_unmask,
        msg.encode_unmask(
            (
                msg.Reveal("a", msg.Secret.SELF_MASK, _SHARE),
                msg.Reveal("b", msg.Secret.MASK_KEY, _SHARE),
            )
        ),
    ),
    "bundle": (msg.decode_bundle, msg.encode_bundle(msg.ShareBundle(_SHARE, _SHARE))),
}


#: Raw byte strings per Hypothesis example; each gives three inputs (see ``_inputs``).
BATCH = 10


def _inputs(valid: bytes, noise: bytes) -> tuple[bytes, bytes, bytes]:
    """The noise itself; a valid header followed by the noise; the valid message with the
    noise applied as (position, value) edits and a cut at the last noise byte."""
    edited = bytearray(valid)
    for pos, value in zip(noise[0::2], noise[1::2], strict=False):
        edited[pos % len(edited)] = value
    cut = len(edited) - (noise[-1] % 4) if noise and noise[-1] & 0x80 else len(edited)
    return noise, valid[:5] + noise, bytes(edited[:cut])


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_raises_only_its_own_error(name: str) -> None:
    decode, valid = DECODERS[name]
    decode(valid)  # the seed message is valid
    tried = 0

    @settings(
        max_examples=-(-EXAMPLES // (3 * BATCH)),
        deadline=None,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(batch=st.lists(st.binary(max_size=300), min_size=BATCH, max_size=BATCH))
    def run(batch: list[bytes]) -> None:
        nonlocal tried
        for noise in batch:
            for data in _inputs(valid, noise):
                tried += 1
                with contextlib.suppress(SecAggMessageError):
                    decode(data)

    run()
    assert tried >= EXAMPLES
