"""The server's rendezvous peer for server-less rounds (``python -m flotilla.p2p.rendezvous``).

A bare hivemind DHT node the federation server runs as a child process: devices of a
``transport = "p2p"`` job join the DHT through it and find their round's group there. It
keeps its peer identity in its state dir, so its multiaddrs survive a server restart, and
writes ``rendezvous.json`` (``{"maddrs": [...]}``) once it is up.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flotilla.core.files import write_atomic

READY_FILE = "rendezvous.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flotilla.p2p.rendezvous")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--host-maddrs", nargs="+", default=None)
    parser.add_argument("--announce-maddrs", nargs="+", default=None)
    args = parser.parse_args(argv)

    from flotilla.core.lifetime import end_with_parent, stop_on_signals
    from flotilla.p2p.dht import start_dht, visible_maddrs

    end_with_parent()  # only ever a server's child
    stop = stop_on_signals()
    dht = start_dht(
        host_maddrs=args.host_maddrs,
        identity_path=args.state_dir / "identity.key",
        announce_maddrs=args.announce_maddrs,
    )
    try:
        maddrs = visible_maddrs(dht)
        write_atomic(args.state_dir / READY_FILE, json.dumps({"maddrs": maddrs}).encode())
        stop.wait()
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
