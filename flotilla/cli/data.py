"""``flotilla data shard``: a device's shard of a task's data, as a file it can keep.

Devices that hold their data as files (a phone, the torch-free ``flotilla-lite``) get
exactly the examples a ``flotilla client --shard i/N`` agent would train on under the same
``[data]`` settings: the task's own ``load_shard`` deals them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flotilla.core.errors import SpecError


def add_data_parser(commands: Any) -> None:
    data = commands.add_parser("data", help="device data files")
    sub = data.add_subparsers(title="data commands", metavar="ACTION")
    shard = sub.add_parser(
        "shard",
        help="write a device's shard (x_train, y_train, x_val, y_val) as .npz",
        description="Write the shard a `flotilla client --shard i/N` agent trains on, for "
        "devices that read their data from a file (flotilla-lite).",
    )
    shard.add_argument("--task", required=True, help="task entry point, package.module:Name")
    shard.add_argument("--shard", required=True, help="this device's shard, i/N")
    shard.add_argument("--alpha", type=float, default=0.5, help="the job's data.alpha")
    shard.add_argument("--seed", type=int, default=0, help="the job's data.seed")
    shard.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE",
        help="one of the job's data.params (value read as TOML); repeatable",
    )  # fmt: skip
    shard.add_argument("--out", type=Path, required=True, help="the .npz to write")
    shard.set_defaults(handler=write_shard_file)


def write_shard_file(args: argparse.Namespace) -> int:
    """Deal the shard with the task's ``load_shard`` and write it with its provenance."""
    from flotilla.core.spec import DataSection, apply_override
    from flotilla.core.tables import build_dataclass
    from flotilla.mobile.lite.data import ShardInfo, write_shard
    from flotilla.tasks import Shard, load_task

    try:
        shard = Shard.parse(args.shard)
    except ValueError as exc:
        raise SpecError(f"--shard: {exc}") from exc
    raw: dict[str, Any] = {"alpha": args.alpha, "seed": args.seed, "params": {}}
    for item in args.param:
        apply_override(raw["params"], item, "--param")
    data = build_dataclass(DataSection, raw, "flotilla data shard", "data.")
    task = load_task(args.task)
    try:
        local = task.load_shard(shard, data)
    except ValueError as exc:
        raise SpecError(f"{args.task} cannot deal shard {shard}: {exc}") from exc
    arrays = {
        "x_train": local.train[0].numpy(),
        "y_train": local.train[1].numpy(),
        "x_val": local.val[0].numpy(),
        "y_val": local.val[1].numpy(),
    }
    info = ShardInfo(args.task, shard.index, shard.count, data.alpha, data.seed, data.params)
    write_shard(args.out, arrays, info)
    print(
        f"wrote {args.out}: {len(arrays['y_train'])} training and {len(arrays['y_val'])} "
        f"validation examples of {args.task}, shard {shard}"
    )
    return 0
