"""``flotilla-lite`` (``python -m flotilla.mobile.lite``): the torch-free reference client.

    flotilla-lite --server http://HOST:PORT --token T --data SHARD.npz
                  [--state-dir D] [--conditions FILE] [--tls-ca F]
                  [--tls-cert F --tls-key F] [--program DIR]

``--program DIR`` trains through the ExecuTorch program ``flotilla job export`` wrote in DIR
instead of the NumPy MLP; only that option imports ExecuTorch (the ``mobile-export`` extra).

Arguments, the data file and the conditions file are checked before anything connects, so
a wrong path or a malformed file fails at once with a message that names it. Errors map to
the exit codes of ``flotilla``: 2 bad arguments or files, 3 refused credentials, 4 not
found, 5 server unreachable, 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.errors import AuthError, FlotillaError, NotFoundError, SpecError, Unreachable
from flotilla.mobile.lite.conditions import LiteConditions
from flotilla.mobile.lite.data import ShardFile, read_shard
from flotilla.mobile.lite.device import LiteDevice
from flotilla.mobile.lite.http import HttpDevice
from flotilla.mobile.lite.mlp import Examples
from flotilla.mobile.lite.rounds import LiteTrainer, LocalTraining
from flotilla.mobile.lite.state import LiteState

EXIT_CODES: dict[type[FlotillaError], int] = {
    SpecError: 2, AuthError: 3, NotFoundError: 4, Unreachable: 5,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class LiteOptions:
    """The command line, checked: what :func:`run` starts from."""

    #: ``http://HOST:PORT`` or ``https://HOST:PORT``, without a trailing slash.
    server: str
    token: str
    data_path: Path
    data: ShardFile
    #: None: a temporary directory for this run (nothing survives a restart).
    state_dir: Path | None
    conditions: LiteConditions
    tls_ca: Path | None
    device_class: str = ""
    #: Stop after this many offered rounds (None: until stopped).
    max_rounds: int | None = None
    #: How rounds are trained: None for the NumPy MLP, or the ``--program`` it loaded.
    training: LocalTraining | None = None
    #: This device's own certificate and key, for a server with mutual TLS.
    tls_cert: Path | None = None
    tls_key: Path | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flotilla-lite",
        description="A torch-free device: trains the digits task in NumPy and speaks only "
        "the HTTP device protocol (docs/protocol.md, docs/lite-client.md).",
    )
    parser.add_argument(
        "--server", required=True,
        help="http://HOST:PORT (or https://); several servers of one deployment, comma-"
        "separated, are tried in turn",
    )  # fmt: skip
    parser.add_argument("--token", required=True, help="enrolment token")
    parser.add_argument(
        "--data", type=Path, required=True, metavar="SHARD.npz",
        help="this device's data, as `flotilla data shard` writes it",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", type=Path, default=None, metavar="D",
        help="keeps the credential, transfers in progress and per-job state",
    )  # fmt: skip
    parser.add_argument(
        "--conditions", type=Path, default=None, metavar="FILE",
        help="JSON {charging, battery, network, idle[, thermal]}, re-read at every poll",
    )  # fmt: skip
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="F", help="CA for https")
    parser.add_argument(
        "--tls-cert", type=Path, default=None, metavar="F",
        help="this device's certificate, for a server with --tls-client-ca (CN: device id)",
    )  # fmt: skip
    parser.add_argument("--tls-key", type=Path, default=None, metavar="F", help="its key")
    parser.add_argument(
        "--device-class", default="", metavar="C",
        help="what this device is (phone, sbc, laptop...): jobs may select by class",
    )  # fmt: skip
    parser.add_argument(
        "--max-rounds", type=int, default=None, metavar="N",
        help="leave after N offered rounds (default: serve until stopped)",
    )  # fmt: skip
    parser.add_argument(
        "--program", type=Path, default=None, metavar="DIR",
        help="train through the ExecuTorch program `flotilla job export ID --format "
        "executorch --out DIR` wrote (needs the mobile-export extra)",
    )  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def check_options(args: argparse.Namespace) -> LiteOptions:
    """SpecError naming the first bad argument or file."""
    server = _server_url(args.server)
    if not args.token.strip():
        raise SpecError("--token is empty")
    if args.tls_ca is not None:
        if not server.startswith("https://"):
            raise SpecError("--tls-ca is for an https:// server")
        if not args.tls_ca.is_file():
            raise SpecError(f"--tls-ca: no such file {args.tls_ca}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SpecError("--tls-cert and --tls-key go together")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not server.startswith("https://"):
            raise SpecError(f"{flag} is for an https:// server")
        if path is not None and not path.is_file():
            raise SpecError(f"{flag}: no such file {path}")
    data = read_shard(args.data)
    LiteTrainer(data)  # the digits task's checks: 64 pixels in [0, 1], labels 0..9
    conditions = LiteConditions(args.conditions)
    conditions.read()  # a malformed file fails now; later reads treat it as unknown
    if args.state_dir is not None and args.state_dir.exists() and not args.state_dir.is_dir():
        raise SpecError(f"--state-dir: {args.state_dir} is not a directory")
    if args.max_rounds is not None and args.max_rounds < 1:
        raise SpecError("--max-rounds must be at least 1")
    training = None if args.program is None else _program(args.program, data)
    return LiteOptions(
        server, args.token, args.data, data, args.state_dir, conditions, args.tls_ca,
        args.device_class, args.max_rounds, training, args.tls_cert, args.tls_key,
    )  # fmt: skip


def _program(directory: Path, data: ShardFile) -> LocalTraining:
    """``--program DIR`` loaded and checked against the data; SpecError (exit 2) when DIR is
    not an export or ExecuTorch is not installed. Imported here only: the base install has
    no ExecuTorch, and the rest of the lite client never needs it."""
    if not directory.is_dir():
        raise SpecError(f"--program: {directory} is not a directory")
    from flotilla.mobile.lite.program import ProgramTraining

    training = ProgramTraining.load(directory)
    training.check_examples(Examples(data.x_train, data.y_train))
    return training


def _server_url(text: str) -> str:
    parsed = urllib.parse.urlsplit(text.strip())
    try:
        port = parsed.port
    except ValueError as exc:
        raise SpecError(f"--server {text!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise SpecError(f"--server must look like http://HOST:PORT, got {text!r}")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise SpecError(f"--server takes no path (the protocol lives under /device/v1/): {text!r}")
    return f"{parsed.scheme}://{parsed.netloc}"


def run(options: LiteOptions) -> int:
    """Enrol, then poll, train and upload until SIGTERM or Ctrl-C; the exit code."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        state_dir = options.state_dir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="flotilla-lite-"))
        )
        http = HttpDevice(
            options.server,
            tls_ca=options.tls_ca,
            tls_cert=options.tls_cert,
            tls_key=options.tls_key,
        )
        device = LiteDevice(
            http,
            LiteState(state_dir, options.server),
            LiteTrainer(options.data, LiteState(state_dir, options.server), options.training),
            options.conditions,
            options.device_class,
        )
        with contextlib.suppress(KeyboardInterrupt):
            device.run(options.token, stop, options.max_rounds)
        with contextlib.suppress(FlotillaError):
            http.leave("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run(check_options(args))
    except FlotillaError as exc:
        print(f"flotilla-lite: error: {exc}", file=sys.stderr)
        return next((c for t, c in EXIT_CODES.items() if isinstance(exc, t)), 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
