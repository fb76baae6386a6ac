"""Small experiment files for the simulator, and reading back what a run wrote."""

from __future__ import annotations

import json
from pathlib import Path


def experiment_file(tmp_path: Path, body: str = "", *, name: str = "exp.toml") -> Path:
    """A small digits experiment: 60 augmented clients, 10 per round, a few rounds."""
    text = f"""
[job]
name = "small"
rounds = 4
clients_per_round = 10
over_selection = 1.2
min_quorum = 5
round_deadline_s = 120.0

[train]
local_epochs = 1
batch_size = 16

[data]
alpha = 0.5
params = {{ augment = true, min_samples = 20, max_samples = 40 }}

[population]
clients = 60
dropout = 0.1

[[population.classes]]
name = "phone"
share = 0.7
speed_median = 0.5
upload_mbps = 5.0

[[population.classes]]
name = "server"
share = 0.3
speed_median = 10.0
upload_mbps = 200.0
{body}
"""
    path = tmp_path / name
    path.write_text(text)
    return path


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]
