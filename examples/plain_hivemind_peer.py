"""A peer of a flotilla volunteer run written with plain hivemind (docs/p2p.md).

It uses only hivemind (and ``cryptography``, which hivemind itself depends on), torch and
the run's task for its model and text: it reads the run record from the DHT, checks the
coordinator's Ed25519 signature, and trains with a ``hivemind.Optimizer`` configured from
the record. A verified run (the default) averages only between flotilla peers, so this
peer stops at once and says what would let it in; a run whose coordinator was started
with ``--plain-averaging`` takes it like any other peer.

    python examples/plain_hivemind_peer.py --run docs-lm --initial-peers MADDR --epochs 3
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time

import hivemind
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from flotilla.tasks.charlm import CharLMTask, windows


def read_record(dht: hivemind.DHT, run: str, wait_s: float) -> dict:
    """The run's record, once its signature checks out (``{run}_flotilla_v1_record``)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = dht.get(f"{run}_flotilla_v1_record", latest=True)
        for subkey, entry in (found.value if found is not None else {}).items():
            signed = entry.value  # {"record_json", "signature", "public_key"}, base64 fields
            if subkey != signed["public_key"]:
                continue  # stored under another key than its signer's
            key = Ed25519PublicKey.from_public_bytes(base64.b64decode(signed["public_key"]))
            key.verify(base64.b64decode(signed["signature"]), signed["record_json"].encode())
            return dict(json.loads(signed["record_json"]))
        time.sleep(0.5)
    raise SystemExit(f"no signed record for run {run!r} within {wait_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--epochs", type=int, default=3, help="stop after this many epochs")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    dht = hivemind.DHT(
        initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
    )
    record = read_record(dht, args.run, wait_s=60.0)
    if record["averaging"] == "gossip":
        dht.shutdown()
        print(
            f"run {args.run} averages by gossip (flotilla's push-sum shares, docs/p2p-protocol.md"
            "), which hivemind.Optimizer does not speak",
            file=sys.stderr,
        )
        return 3
    if record["verified_averaging"]:
        dht.shutdown()
        print(
            f"run {args.run} averages only between flotilla peers (verified, whole-or-nothing"
            " rounds): a plain hivemind peer can join a run whose coordinator was started"
            " with --plain-averaging",
            file=sys.stderr,
        )
        return 3
    if record["task"] != "flotilla.tasks.charlm:CharLMTask" or record["compression"] != "none":
        dht.shutdown()
        print(f"this example trains the char LM without compression: {record}", file=sys.stderr)
        return 2

    task = CharLMTask()
    model = task.build_model(record["seed"])
    inputs, targets = windows(task.tokens(), task.context)
    if record["optimizer"] == "adam":
        optimizer = lambda params: torch.optim.Adam(params, lr=record["learning_rate"])  # noqa: E731
    else:
        optimizer = lambda params: torch.optim.SGD(  # noqa: E731
            params, lr=record["learning_rate"], momentum=0.9
        )
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=record["run"],  # a run open to plain peers: its swarm is the run's name
        params=model.parameters(),
        optimizer=optimizer,
        target_batch_size=record["target_batch_size"],
        batch_size_per_step=args.batch_size,
        matchmaking_time=record["matchmaking_time"],
        averaging_timeout=record["averaging_timeout"],
        allreduce_timeout=record["allreduce_timeout"],
        next_chunk_timeout=record["next_chunk_timeout"],
        load_state_timeout=record["load_state_timeout"],
        use_local_updates=record["averaging"] == "state",
        averager_opts={"request_timeout": min(3.0, record["matchmaking_time"] / 2)},
        verbose=True,  # hivemind logs "Averaged gradients with N peers" each epoch
    )
    opt.load_state_from_peers()
    first, gen = opt.local_epoch, torch.Generator().manual_seed(int(time.time()))
    print(f"joined run {args.run} at epoch {first} as {dht.peer_id}", flush=True)
    try:
        while opt.local_epoch < first + args.epochs:
            idx = torch.randint(len(targets), (args.batch_size,), generator=gen)
            logits = model(inputs[idx])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[idx].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"epoch {opt.local_epoch} loss {loss.item():.4f}", flush=True)
    finally:
        opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
