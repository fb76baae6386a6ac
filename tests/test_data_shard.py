"""``flotilla data shard`` writes exactly the shard a ``--shard i/N`` agent trains on, and the
lite client reads such files strictly: no pickles, and malformed ones refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flotilla.cli import main
from flotilla.core.errors import SpecError
from flotilla.core.spec import DataSection
from flotilla.mobile.lite import ShardInfo, read_shard, write_shard
from flotilla.tasks import DigitsTask, Shard

DIGITS = "flotilla.tasks.digits:DigitsTask"


@pytest.mark.timeout(60)
def test_the_file_is_the_agents_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dev" / "s.npz"
    argv = ["data", "shard", "--task", DIGITS, "--shard", "2/6", "--alpha", "0.3",
            "--seed", "9", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "shard 2/6" in capsys.readouterr().out
    data = DataSection(alpha=0.3, seed=9)
    local = DigitsTask().load_shard(Shard(2, 6), data)
    got = read_shard(out)
    for mine, theirs in zip(
        (got.x_train, got.y_train, got.x_val, got.y_val), (*local.train, *local.val), strict=True
    ):
        assert mine.dtype == theirs.numpy().dtype and np.array_equal(mine, theirs.numpy())
    assert got.info == ShardInfo(DIGITS, 2, 6, 0.3, 9, {})
    assert got.info.differs_from(data) is None
    assert "alpha=0.5" in (got.info.differs_from(DataSection(alpha=0.5, seed=9)) or "")
    with np.load(out, allow_pickle=False) as archive:  # plain arrays only
        assert all(archive[k].dtype != object for k in archive.files)

    augmented = tmp_path / "aug.npz"
    argv = ["data", "shard", "--task", DIGITS, "--shard", "0/2000", "--param", "augment=true",
            "--out", str(augmented)]  # fmt: skip
    assert main(argv) == 0
    params = {"augment": True}
    local = DigitsTask().load_shard(Shard(0, 2000), DataSection(params=params))
    got = read_shard(augmented)
    assert np.array_equal(got.x_train, local.train[0].numpy()) and got.info.params == params


def test_bad_arguments_exit_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x.npz")
    assert main(["data", "shard", "--task", DIGITS, "--shard", "6/6", "--out", out]) == 2
    assert "shard index" in capsys.readouterr().err
    assert main(["data", "shard", "--task", "nope:Nope", "--shard", "0/2", "--out", out]) == 1
    assert "cannot import" in capsys.readouterr().err
    argv = ["data", "shard", "--task", DIGITS, "--shard", "0/1000", "--out", out]
    assert main(argv) == 2
    assert "cannot deal shard 0/1000" in capsys.readouterr().err
    assert not Path(out).exists()


def good_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.random((20, 64), dtype=np.float32),
        "y_train": rng.integers(0, 10, 20),
        "x_val": rng.random((3, 64), dtype=np.float32),
        "y_val": rng.integers(0, 10, 3),
    }


def test_malformed_files_are_refused_by_name(tmp_path: Path) -> None:
    info = ShardInfo(DIGITS, 0, 1, 0.5, 0, {})
    good = tmp_path / "good.npz"
    write_shard(good, good_arrays(), info)
    assert read_shard(good).info == info
    meta = {"format": np.array("flotilla.shard/1"), "task": np.array(DIGITS),
            "shard": np.array([0, 1]), "alpha": np.array(0.5), "seed": np.array(0),
            "data_params": np.array(json.dumps({}))}  # fmt: skip

    def refused(name: str, arrays: dict[str, np.ndarray], match: str) -> None:
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(SpecError, match=match):
            read_shard(path)

    arrays = good_arrays()
    refused("missing", {**{k: v for k, v in arrays.items() if k != "y_val"}, **meta}, "y_val")
    refused("extra", {**arrays, **meta, "z": np.zeros(1)}, r"unexpected arrays \['z'\]")
    refused("nan", {**arrays, **meta, "x_val": np.full((3, 64), np.nan)}, "x_val holds NaN")
    refused("rows", {**arrays, **meta, "y_train": np.zeros(5, np.int64)}, "same number")
    refused("dtype", {**arrays, **meta, "y_train": np.zeros(20)}, "integers")
    refused("format", {**arrays, **meta, "format": np.array("v0")}, "format")
    refused("pickled", {**arrays, **meta, "task": np.array([{"a": 1}], dtype=object)}, "pickle")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(SpecError, match="not a shard file"):
        read_shard(tmp_path / "junk.npz")
    with pytest.raises(SpecError, match="not a shard file"):
        read_shard(tmp_path / "absent.npz")
    with pytest.raises(SpecError, match="NaN"):
        write_shard(tmp_path / "w.npz", {**good_arrays(), "x_train": np.full((2, 64), np.inf),
                                          "y_train": np.zeros(2, np.int64)}, info)  # fmt: skip
