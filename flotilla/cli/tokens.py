"""``flotilla server token``: create, list and revoke enrolment tokens (and mint read
tokens), straight in the server's database; the server need not be running."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from flotilla.core.records import EnrolTokenRecord


def add_token_parser(sub: Any) -> None:
    """``token create|list|revoke`` under ``flotilla server``."""
    token = sub.add_parser("token", help="manage enrolment and read tokens")
    token_sub = token.add_subparsers(title="token commands", metavar="ACTION")
    create = token_sub.add_parser(
        "create", help="mint an enrolment token (its id on stderr, the token printed last)"
    )
    _where(create)
    create.add_argument(
        "--read-only", action="store_true",
        help="mint a read token for the HTTP API and dashboard instead (it cannot enrol)",
    )  # fmt: skip
    create.add_argument(
        "--uses", type=int, default=None, metavar="N",
        help="enrolments it admits (default: unlimited)",
    )  # fmt: skip
    create.add_argument(
        "--expires", default=None, metavar="DURATION",
        help="how long it admits enrolments: 30m, 24h, 7d (default: never expires)",
    )  # fmt: skip
    create.set_defaults(handler=_create)
    listing = token_sub.add_parser("list", help="enrolment tokens: id, uses left, expiry, state")
    _where(listing)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=_list)
    revoke = token_sub.add_parser("revoke", help="revoke an enrolment token by its id, at once")
    revoke.add_argument("id", help="the token's id, as 'token create' and 'token list' show it")
    _where(revoke)
    revoke.add_argument("--json", action="store_true")
    revoke.set_defaults(handler=_revoke)


def _where(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=Path("flotilla-state"))
    p.add_argument("--db", default=None, help="database URL (default: the server's)")


def token_json(t: EnrolTokenRecord) -> dict[str, Any]:
    return {
        "id": t.id,
        "created_at": t.created_at,
        "uses_left": t.uses_left,
        "expires_at": t.expires_at,
        "revoked_at": t.revoked_at,
        "state": t.state,
    }


def _when(at: float | None, never: str) -> str:
    if at is None:
        return never
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _create(args: argparse.Namespace) -> int:
    from flotilla.core.errors import SpecError
    from flotilla.server.federation import tokens

    if args.read_only:
        if args.uses is not None or args.expires is not None:
            raise SpecError("--uses and --expires are for enrolment tokens, not --read-only")
        print(asyncio.run(tokens.create_read_token(args.state_dir, args.db)))
        return 0
    expires_s = None if args.expires is None else tokens.parse_duration(args.expires)
    if args.uses is not None and args.uses < 1:
        raise SpecError(f"--uses: a token admits at least 1 enrolment, got {args.uses}")
    minted = asyncio.run(tokens.create_enrol_token(args.state_dir, args.db, args.uses, expires_s))
    uses = "unlimited" if minted.uses is None else str(minted.uses)
    print(
        f"token id {minted.id}: {uses} uses, expires {_when(minted.expires_at, 'never')} UTC",
        file=sys.stderr,
    )
    print(minted.token)
    return 0


def _list(args: argparse.Namespace) -> int:
    from flotilla.server.federation import tokens

    found = asyncio.run(tokens.list_enrol_tokens(args.state_dir, args.db))
    if args.json:
        print(json.dumps([token_json(t) for t in found], indent=2))
        return 0
    print(f"{'ID':<14}{'CREATED (UTC)':<18}{'USES LEFT':<11}{'EXPIRES (UTC)':<18}STATE")
    for t in found:
        uses = "unlimited" if t.uses_left is None else str(t.uses_left)
        print(
            f"{t.id:<14}{_when(t.created_at, '-'):<18}{uses:<11}"
            f"{_when(t.expires_at, 'never'):<18}{t.state}"
        )
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from flotilla.server.federation import tokens

    revoked = asyncio.run(tokens.revoke_enrol_token(args.state_dir, args.id, args.db))
    if args.json:
        print(json.dumps(token_json(revoked), indent=2))
    else:
        print(f"token {revoked.id} revoked")
    return 0
