"""The shared part of every fuzz harness: the contract one input must keep, the run
settings, and byte mutations of valid messages.

A harness is a :class:`Target` (a name, a function of raw bytes, the errors it may raise)
plus a Hypothesis strategy of inputs. :func:`fuzz` runs the strategy's inputs through
:func:`check`, which holds each input to the contract:

* only errors of our tree (or those the target names, such as protobuf's DecodeError that
  gRPC maps itself) escape: never IndexError, KeyError, struct.error, RecursionError...;
* at most ``MEMORY_BOUND`` bytes allocated above the start, by tracemalloc's peak (NumPy
  reports its buffers to tracemalloc, so an array sized from hostile bytes counts);
* at most ``TIME_BOUND_S`` per input (Hypothesis' deadline; pytest-timeout ends a real
  hang).

Why tracemalloc and not RLIMIT_AS in a subprocess: it measures one input, not a process
whose address space NumPy, BLAS threads and Hypothesis already fill, and it needs no child
per input. Inputs come from ``FLOTILLA_FUZZ_EXAMPLES`` (10,000 unless set). CI runs are
derandomized; ``FLOTILLA_FUZZ_SEED=random`` (or a number) draws a fresh run and prints the
seed, so a failure reproduces with that seed. The same ``check`` serves atheris
(``tests/fuzz/atheris_main.py``) for long runs.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from flotilla.core.errors import FlotillaError

#: Most bytes one input may allocate (tracemalloc peak above the level before it).
MEMORY_BOUND = 64 * 1024 * 1024
#: Longest one input may take, in seconds.
TIME_BOUND_S = 1.0
#: Inputs per harness in CI.
CI_EXAMPLES = 10_000


@dataclass(frozen=True)
class Target:
    """One decoder under fuzz: ``run(data)`` must return or raise one of ``allowed``."""

    name: str
    run: Callable[[bytes], object]
    allowed: tuple[type[BaseException], ...] = (FlotillaError,)
    memory_bound: int = MEMORY_BOUND


@dataclass
class Tally:
    """What a run saw: inputs, and how many each allowed error refused."""

    inputs: int = 0
    refused: dict[str, int] = field(default_factory=dict)


def check(target: Target, data: bytes, tally: Tally | None = None) -> None:
    """Run one input; AssertionError if it breaks the contract (the input is in the message)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            target.run(data)
        except target.allowed as exc:
            if tally is not None:
                name = type(exc).__name__
                tally.refused[name] = tally.refused.get(name, 0) + 1
        except Exception as exc:
            raise AssertionError(
                f"{target.name}: {type(exc).__name__} escaped ({exc!s:.300}) on input "
                f"{_shown(data)}"
            ) from exc
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    if tally is not None:
        tally.inputs += 1
    assert peak <= target.memory_bound, (
        f"{target.name}: {peak} bytes allocated (bound {target.memory_bound}) on {_shown(data)}"
    )


def _shown(data: bytes) -> str:
    return repr(data) if len(data) <= 400 else f"{data[:400]!r}... ({len(data)} bytes)"


def examples() -> int:
    return int(os.environ.get("FLOTILLA_FUZZ_EXAMPLES", CI_EXAMPLES))


def run_seed() -> int | None:
    """None: derandomized (CI). A number from FLOTILLA_FUZZ_SEED, or a fresh one for
    ``random``."""
    raw = os.environ.get("FLOTILLA_FUZZ_SEED", "")
    if not raw:
        return None
    return random.SystemRandom().randrange(2**32) if raw == "random" else int(raw)


def fuzz(
    target: Target, inputs: st.SearchStrategy[bytes], regressions: Sequence[bytes] = ()
) -> Tally:
    """Run ``examples()`` inputs (after the ``regressions``, each checked first) through
    ``target``; fails on the first input that breaks the contract."""
    tally = Tally()
    for data in regressions:
        check(target, data, tally)
    count, chosen = examples(), run_seed()
    how = "derandomized" if chosen is None else f"FLOTILLA_FUZZ_SEED={chosen}"
    print(f"fuzz {target.name}: {count} inputs, {how}", file=sys.stderr)

    @settings(
        max_examples=count,
        derandomize=chosen is None,
        database=None,
        deadline=timedelta(seconds=TIME_BOUND_S),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs)
    def one(data: bytes) -> None:
        check(target, data, tally)

    run = one if chosen is None else seed(chosen)(one)
    try:
        run()
    except BaseException:
        print(f"fuzz {target.name}: failed; rerun with the same settings ({how})", file=sys.stderr)
        raise
    assert tally.inputs >= count, f"{target.name}: only {tally.inputs} of {count} inputs ran"
    accepted = tally.inputs - sum(tally.refused.values())
    print(f"fuzz {target.name}: {accepted} accepted, refused {tally.refused}", file=sys.stderr)
    return tally


# --- structure-aware inputs ------------------------------------------------------------------
#
# Hypothesis draws a recipe (a valid seed message and a 64-bit number) and a seeded PRNG
# applies the mutations: drawing every mutation through Hypothesis costs ~1.5 ms of CPU per
# input, the recipe ~0.3 ms, and the CI share must stay near 90 s. A failing input is
# printed whole, so nothing is lost by shrinking a number instead of the bytes.

#: Values a patched length or count takes: edges of every integer width a decoder reads.
INTERESTING = (
    0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1,
    2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1,
)  # fmt: skip
_TEXT_BYTES = b'{}[]",:0123456789e.-= \n\\'


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def mutate(seed_message: bytes, rng: random.Random, max_extra: int = 64) -> bytes:
    """One to four mutations of a valid message: a byte flipped, truncated, extended,
    spliced, a span deleted or repeated, a length patched (u8, u32, u64 or varint) with an
    edge value, a character a text format cares about written in."""
    data = bytearray(seed_message)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        at = rng.randint(0, len(data))
        if op == 0 and data:  # flip bits of one byte
            data[min(at, len(data) - 1)] ^= rng.randint(1, 255)
        elif op == 1:  # truncate
            del data[at:]
        elif op == 2:  # extend
            data += rng.randbytes(rng.randint(0, max_extra))
        elif op == 3:  # splice random bytes in
            data[at:at] = rng.randbytes(rng.randint(1, max_extra))
        elif op == 4:  # delete a span
            del data[at : at + rng.randint(1, 16)]
        elif op == 5:  # repeat a span
            data[at:at] = bytes(data[at : at + rng.randint(1, 32)]) * rng.randint(1, 8)
        elif op == 6:  # patch a length: an edge value at a width
            value = rng.choice(INTERESTING)
            width = rng.choice(("B", "<I", "<Q", "varint"))
            raw = (
                varint(value)
                if width == "varint"
                else struct.pack(width, value % (1 << (8 * struct.calcsize(width))))
            )
            data[at : at + len(raw)] = raw
        elif data:
            data[min(at, len(data) - 1)] = rng.choice(_TEXT_BYTES)
    return bytes(data)


def recipes(
    seeds: Sequence[bytes], make: Callable[[bytes, random.Random], bytes]
) -> st.SearchStrategy[bytes]:
    """Inputs ``make`` builds from a drawn seed message and a drawn PRNG seed."""
    return st.builds(
        lambda message, number: make(message, random.Random(number)),
        st.sampled_from(list(seeds)),
        st.integers(0, 2**64 - 1),
    )


def mutated(seeds: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    """Mostly mutations of valid messages, one input in ten raw bytes: random bytes alone
    never pass a header, mutations of valid ones reach what lies behind it."""
    return st.one_of(
        st.binary(max_size=256),
        *[recipes(seeds, mutate)] * 9,
    )


def json_value(rng: random.Random, depth: int = 3) -> object:
    """A JSON value with the edges parsers trip on (huge ints, NaN, long text, nesting)."""
    kind = rng.randrange(10 if depth > 0 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice((*INTERESTING, -1, -(2**63), 10**30, 10**400, -(10**400)))
    if kind == 3:
        return rng.randint(-5, 300)
    if kind == 4:
        return rng.choice((0.5, -0.0, 1e308, float("nan"), float("inf"), -1.5))
    if kind == 5:
        return rng.choice(("", "x", "job-1", "a" * 300, "\u0000", "\ud800", "0" * 64))
    if kind == 6:
        return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 12)))
    if kind == 7:
        return "f" * 64
    if kind == 8:
        return [json_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {str(json_value(rng, 0))[:20]: json_value(rng, depth - 1) for _ in range(3)}
