"""Long fuzz runs under atheris (coverage-guided libFuzzer) over the same targets and the
same per-input contract as the CI share; docs/fuzzing.md says how to run it.

    python -m tests.fuzz.atheris_main TARGET [CORPUS_DIR] [libFuzzer flags]

Without a corpus directory the target's valid seed messages start one in a temporary
directory. ``-timeout=1`` and ``-rss_limit_mb`` are libFuzzer's own bounds; the contract's
AssertionError (an error outside our tree, or memory past the bound by tracemalloc) is a
crash, saved as ``crash-*`` for replay (pass the file instead of a directory).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.fuzz.harness import Target


def targets() -> dict[str, Callable[[], tuple[Target, Sequence[bytes]]]]:
    """Every harness's target and seeds, imported when picked (under instrumentation)."""

    def tensors() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_tensors as m

        return m.TARGET, m.SEEDS

    def blobs() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_blobs as m

        return m.TARGET, m.SEEDS

    def bulk() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_proto as m

        return m.BULK, m.BULK_SEEDS

    def requests() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_proto as m

        return m.REQUESTS, m.REQUEST_SEEDS

    def device_json() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_device_json as m

        return m.TARGET, m.SEEDS

    def toml() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_jobspec as m

        return m.TOML, m.TOML_SEEDS

    def spec_json() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_jobspec as m

        return m.SPEC_JSON, m.JSON_SEEDS

    def byteranges() -> tuple[Target, Sequence[bytes]]:
        from tests.fuzz import test_fuzz_byteranges as m

        return m.TARGET, m.SEEDS

    def codec(name: str) -> Callable[[], tuple[Target, Sequence[bytes]]]:
        def make() -> tuple[Target, Sequence[bytes]]:
            from tests.fuzz.test_fuzz_codecs import codec_target

            return codec_target(name)

        return make

    from flotilla.compression import CODEC_NAMES

    found = {
        "tensors": tensors,
        "blobs": blobs,
        "proto-bulk": bulk,
        "proto-requests": requests,
        "device-json": device_json,
        "jobspec-toml": toml,
        "jobspec-json": spec_json,
        "byteranges": byteranges,
    }
    found.update({f"codec-{name}": codec(name) for name in CODEC_NAMES})
    return found


def main(argv: list[str]) -> None:
    import atheris  # type: ignore[import-not-found]

    from tests.fuzz.harness import check

    with atheris.instrument_imports(include=["flotilla"]):  # coverage guides the mutator
        known = targets()
        if len(argv) < 2 or argv[1] not in known:
            sys.exit(f"usage: {argv[0]} TARGET [CORPUS] [flags]; targets: {', '.join(known)}")
        target, seeds = known[argv[1]]()
    rest = argv[2:]
    if not any(not a.startswith("-") for a in rest):
        corpus = Path(tempfile.mkdtemp(prefix=f"fuzz-{target.name}-"))
        for i, seed in enumerate(seeds):
            (corpus / f"seed-{i}").write_bytes(seed)
        rest = [str(corpus), *rest]
    atheris.Setup([argv[0], *rest], lambda data: check(target, data))
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
