"""The simulator: virtual clock, population, batched training, and whole experiments."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flotilla.core.errors import SpecError
from flotilla.core.spec import DataSection, TrainSection
from flotilla.simulation import (
    AvailabilitySection,
    BatchedTrainer,
    DeviceClass,
    LoopTrainer,
    PopulationSection,
    ShardCache,
    SimulationStalled,
    draw_devices,
    load_experiment,
    make_trainer,
    run_experiment,
    run_simulated,
    sessions,
)
from flotilla.tasks import Shard
from flotilla.tasks.digits import DigitsTask
from tests.support.experiments import experiment_file, rows
from tests.support.inproc import InProcessFederation
from tests.support.lifetime import bound

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def without_wall(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("wall")} for r in items]


# --- the virtual clock -------------------------------------------------------------------


def test_waits_pass_in_simulated_seconds_at_once() -> None:
    async def main() -> tuple[float, float, int]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(7200)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), timeout=5)
        value = await asyncio.to_thread(lambda: 42)  # inline: no simulated time passes
        return start, loop.time(), value

    import time

    wall = time.perf_counter()
    start, end, value = run_simulated(main(), start=1000.0)
    assert (start, end, value) == (1000.0, 1000.0 + 7205.0, 42)
    assert time.perf_counter() - wall < 5


def test_thread_errors_reach_the_awaiting_task() -> None:
    def boom() -> None:
        raise ValueError("from the worker")

    async def main() -> None:
        await asyncio.to_thread(boom)

    with pytest.raises(ValueError, match="from the worker"):
        run_simulated(main())


def test_a_simulation_waiting_on_nothing_stalls_loudly() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever set it

    with pytest.raises(SimulationStalled):
        run_simulated(main())


# --- population ----------------------------------------------------------------------------


def test_classes_get_their_share_and_lognormal_speeds() -> None:
    spec = PopulationSection(
        clients=4000,
        classes=(
            DeviceClass("phone", share=0.75, speed_median=0.5, speed_sigma=0.4),
            DeviceClass("gpu", share=0.25, speed_median=20.0, speed_sigma=0.1),
        ),
    )
    devices = draw_devices(spec, seed=3)
    phones = [d for d in devices if d.kind == "phone"]
    assert abs(len(phones) / len(devices) - 0.75) < 0.03
    assert abs(float(np.median([d.speed for d in phones])) - 0.5) < 0.03
    assert min(d.speed for d in devices if d.kind == "gpu") > 10
    assert draw_devices(spec, seed=3) == devices, "a seed gives the same fleet"
    assert draw_devices(spec, seed=4) != devices


def test_slow_devices_hold_different_labels_when_asked() -> None:
    """``speed_order = "ascending"`` with digits ``label_skew = "by_index"``: the related
    scenario of the scheduling study."""
    from flotilla.tasks import Shard
    from flotilla.tasks.digits import DigitsTask

    spec = PopulationSection(clients=200, speed_order="ascending")
    devices = draw_devices(spec, seed=1)
    speeds = [d.speed for d in devices]
    assert speeds == sorted(speeds) and [d.index for d in devices] == list(range(200))
    assert sorted(speeds) == sorted(
        d.speed for d in draw_devices(PopulationSection(clients=200), seed=1)
    ), "the same fleet, reordered"
    task = DigitsTask()
    data = DataSection(alpha=0.5, params={"augment": True, "label_skew": "by_index"})
    modes = [
        int(np.bincount(task.load_shard(Shard(i, 200), data).train[1].numpy()).argmax())
        for i in range(0, 200, 5)
    ]
    expected = [i * 10 // 200 for i in range(0, 200, 5)]
    agree = sum(m == e for m, e in zip(modes, expected, strict=True)) / len(modes)
    assert agree >= 0.8, (modes, expected)


def test_round_time_is_compute_plus_transfer_plus_latency() -> None:
    device = draw_devices(PopulationSection(clients=1), seed=0)[0]
    seconds = device.round_seconds(50, 2, 0.01, down=1_000_000, up=500_000)
    expected = (
        50 * 2 * 0.01 / device.speed
        + 1_000_000 / device.download_bytes_per_s
        + 500_000 / device.upload_bytes_per_s
        + 2 * device.latency_s
    )
    assert seconds == pytest.approx(expected)


def test_a_trace_gives_one_device_per_row(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    with trace.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["class", "speed", "upload_mbps", "download_mbps", "latency_ms"])
        writer.writerow(["phone", 0.5, 8, 40, 90])
        writer.writerow(["desktop", 2.0, 100, 400, 10])
    devices = draw_devices(PopulationSection(clients=4, trace=str(trace)), seed=0)
    assert [d.kind for d in devices] == ["phone", "desktop", "phone", "desktop"]
    assert devices[1].upload_bytes_per_s == pytest.approx(100e6 / 8)
    assert devices[0].latency_s == pytest.approx(0.09)
    trace.write_text("speed,upload_mbps\n1,2\n")
    with pytest.raises(SpecError, match="download_mbps"):
        draw_devices(PopulationSection(clients=1, trace=str(trace)), seed=0)


def test_exponential_sessions_alternate_with_their_means() -> None:
    spec = AvailabilitySection(kind="exponential", mean_on_s=100.0, mean_off_s=300.0)
    changes = list(itertools.islice(sessions(spec, seed=1, index=0), 4001))
    states = [online for _, online in changes]
    assert all(a != b for a, b in itertools.pairwise(states))
    times = np.array([t for t, _ in changes])
    gaps = np.diff(times)
    on_gaps = gaps[[i for i in range(len(gaps)) if states[i]]]
    assert abs(on_gaps.mean() - 100.0) < 10.0


def test_diurnal_devices_are_online_their_hours_each_day() -> None:
    spec = AvailabilitySection(kind="diurnal", online_hours=6.0)
    for index in range(20):
        online_seconds, state, last = 0.0, False, 0.0
        for t, online in sessions(spec, seed=0, index=index):
            if t >= 3 * 86_400:
                break
            if state:
                online_seconds += t - last
            state, last = online, t
        if state:
            online_seconds += 3 * 86_400 - last
        assert online_seconds == pytest.approx(3 * 6 * 3600, rel=1e-6)


def test_population_fields_are_checked(tmp_path: Path) -> None:
    path = experiment_file(tmp_path, "\n[population.availability]\nkind = 'weekly'\n")
    with pytest.raises(SpecError, match="weekly"):
        load_experiment(path)
    path = experiment_file(tmp_path, "\n[simulation]\nspeed = 3\n")
    with pytest.raises(SpecError, match=r"simulation\.speed"):
        load_experiment(path)


def test_jobs_entries_override_the_base_spec(tmp_path: Path) -> None:
    body = """
[[jobs]]
job = { name = "a" }

[[jobs]]
job = { name = "b", rounds = 2 }
aggregation = { strategy = "fedadam", params = { eta = 0.01 } }
"""
    experiment = load_experiment(experiment_file(tmp_path, body), clients=99, seed=5)
    a, b = experiment.jobs
    assert (a.job.name, a.job.rounds, a.aggregation.strategy) == ("a", 4, "fedavg")
    assert (b.job.name, b.job.rounds, b.aggregation.strategy) == ("b", 2, "fedadam")
    assert b.train.batch_size == 16, "what a job does not override comes from the base"
    assert experiment.population.clients == 99 and experiment.seed == 5
    twins = experiment_file(tmp_path, "[[jobs]]\n[[jobs]]\n", name="twins.toml")
    with pytest.raises(SpecError, match="names must differ"):
        load_experiment(twins)
    p2p = experiment_file(tmp_path, '[aggregation]\ntransport = "p2p"\n', name="p2p.toml")
    with pytest.raises(SpecError, match='transport = "server" only'):
        load_experiment(p2p)


# --- client data and batched training ------------------------------------------------------


def test_augmented_digits_give_each_client_its_own_realistic_shard() -> None:
    from flotilla.tasks import Shard
    from flotilla.tasks.digits import DigitsTask

    task = DigitsTask()
    data = DataSection(alpha=0.3, params={"augment": True, "min_samples": 20, "max_samples": 100})
    shards = [task.load_shard(Shard(i, 5000), data) for i in range(50)]
    sizes = [s.num_train + int(s.val[1].shape[0]) for s in shards]
    assert min(sizes) >= 20 and max(sizes) <= 100 and len(set(sizes)) > 10
    first = shards[0].train[0]
    assert float(first.min()) >= 0.0 and float(first.max()) <= 1.0
    again = task.load_shard(Shard(0, 5000), data)
    assert np.array_equal(again.train[0].numpy(), first.numpy()), "seeded"
    held_x, held_y = task.heldout()
    real_x, real_y = DigitsTask().heldout()
    assert np.array_equal(held_x.numpy(), real_x.numpy()), "the held-out split stays real"
    assert np.array_equal(held_y.numpy(), real_y.numpy())
    with pytest.raises(SpecError, match=r"data\.params\.augmnt"):
        task.load_shard(Shard(0, 10), DataSection(params={"augmnt": True}))


class InOrderDigits(DigitsTask):
    """The digits task taking each epoch's batches in the shard's own order."""

    shuffle_batches = False


@pytest.mark.parametrize("mu", [0.05, 0.0], ids=["prox", "no-prox"])
@pytest.mark.parametrize("path", ["stacked", "vmap"])
@pytest.mark.parametrize("task_class", [DigitsTask, InOrderDigits])
def test_batched_training_equals_the_per_client_loop(
    task_class: type[DigitsTask], path: str, mu: float
) -> None:
    """Unequal shards, two epochs, momentum, weight decay, with and without a FedProx
    term (without one, the stacked way folds weight gradients straight into the weights);
    batches shuffled or in order, as the task takes them."""
    from flotilla.tasks import model_state

    task = task_class()
    data = DataSection(params={"augment": True, "min_samples": 5, "max_samples": 90})
    train = TrainSection(
        local_epochs=2,
        batch_size=16,
        learning_rate=0.05,
        momentum=0.9,
        weight_decay=1e-3,
        proximal_mu=mu,
    )
    shards = ShardCache(task, 500)
    clients = list(range(0, 500, 17))
    sizes = {shards.get(data, c).num_train for c in clients}
    assert len(sizes) > 5, "the test needs clients with different amounts of data"
    model = model_state(task.build_model(3))
    loop = LoopTrainer(task, shards).train(model, clients, train, data, seed=11)
    batched = BatchedTrainer(task, shards, group_bytes=4 * 2**20, paths=(path,))
    assert batched.group_size(train, 50_000, 64) < len(clients), "exercise several groups"
    vectorized = batched.train(model, clients, train, data, seed=11)
    assert batched.choice == path
    for a, b in zip(loop, vectorized, strict=True):
        assert a.num_samples == b.num_samples
        for name in a.delta:
            np.testing.assert_allclose(b.delta[name], a.delta[name], rtol=0, atol=1e-5)
        for key in ("train_loss", "train_accuracy", "accuracy", "loss", "num_samples"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], abs=1e-5), key
    other = InOrderDigits if task_class is DigitsTask else DigitsTask
    elsewise = LoopTrainer(other(), ShardCache(other(), 500)).train(model, clients, train, data, 11)
    assert not np.allclose(elsewise[0].delta["net.0.weight"], loop[0].delta["net.0.weight"])


@pytest.mark.parametrize("path", ["stacked", "vmap"])
@pytest.mark.parametrize(
    "train",
    [
        TrainSection(learning_rate=0.1, momentum=0.0),  # Flower's workload: plain SGD
        TrainSection(learning_rate=0.1, momentum=0.0, weight_decay=1e-2),
        TrainSection(local_epochs=2, weight_decay=1e-3, proximal_mu=0.05),
    ],
    ids=["plain-sgd", "sgd-decay", "momentum-decay-prox"],
)
def test_batched_training_equals_the_loop_on_flowers_mlp_task(
    train: TrainSection, path: str
) -> None:
    """The task of docs/simulation.md#bring-your-own-task, as a user wrote it."""
    from flotilla.tasks import importable_from, load_task, model_state

    with importable_from([ROOT / "examples" / "own_task"]):
        task = load_task("flower_mlp:FlowerMLP")
    shards = ShardCache(task, 1000)
    clients = list(range(0, 1000, 97))
    model = model_state(task.build_model(1))
    loop = LoopTrainer(task, shards).train(model, clients, train, DataSection(), seed=4)
    trainer = BatchedTrainer(task, shards, paths=(path,))
    batched = trainer.train(model, clients, train, DataSection(), seed=4)
    assert trainer.choice == path
    for a, b in zip(loop, batched, strict=True):
        assert a.num_samples == b.num_samples == 50
        assert set(a.metrics) == set(b.metrics) == {"train_loss", "train_accuracy"}
        for key in a.metrics:
            assert b.metrics[key] == pytest.approx(a.metrics[key], abs=1e-5), key
        for name in a.delta:
            np.testing.assert_allclose(b.delta[name], a.delta[name], rtol=0, atol=1e-5)


class Centred(torch.nn.Module):
    """Centres each batch on its own mean first: per client under vmap, but across
    clients if a stacked forward took the first dimension for the batch."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x - x.mean(dim=0))
        return out


class CentringDigits(DigitsTask):
    def build_model(self, seed: int) -> torch.nn.Module:
        return Centred(super().build_model(seed))


def test_the_probe_keeps_only_ways_that_give_the_tasks_own_results() -> None:
    from flotilla.simulation.stacked import stack_model
    from flotilla.tasks import model_state

    assert stack_model(DigitsTask().build_model(0)) is not None
    norm = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert stack_model(norm) is None, "a parameter outside a linear layer"
    assert stack_model(torch.nn.Sequential(torch.nn.BatchNorm1d(4))) is None

    task = CentringDigits()
    # Equal shards: every batch of every client is full, as vmap computes it.
    data = DataSection(params={"augment": True, "min_samples": 50, "max_samples": 50})
    shards = ShardCache(task, 200)
    model = model_state(task.build_model(0))
    clients = list(range(40))
    trainer = BatchedTrainer(task, shards)  # stacked and vmap, stacked preferred
    got = trainer.train(model, clients, TrainSection(), data, seed=2)
    assert trainer.choice == "vmap", trainer.probe
    assert "stacked" not in trainer.probe, "its results differ"
    # Unequal shards: vmap pads short batches, which a batch mean would see: the loop.
    mixed = DataSection(params={"augment": True, "min_samples": 20, "max_samples": 60})
    padded = BatchedTrainer(task, shards)
    padded.train(model, clients, TrainSection(), mixed, seed=2)
    assert padded.choice == "loop" and set(padded.probe) == {"loop"}
    want = LoopTrainer(task, shards).train(model, clients, TrainSection(), data, seed=2)
    for a, b in zip(want, got, strict=True):
        for name in a.delta:
            np.testing.assert_allclose(b.delta[name], a.delta[name], rtol=0, atol=1e-5)
    auto = make_trainer(DigitsTask(), ShardCache(DigitsTask(), 200))
    auto.train(model_state(DigitsTask().build_model(0)), clients, TrainSection(), data, seed=2)
    assert isinstance(auto, BatchedTrainer)
    assert set(auto.probe) == {"loop", "stacked", "vmap"}, "every way was timed"
    assert auto.choice in ("stacked", "vmap"), "batched digits beat the loop by far"


def test_clients_without_validation_examples_train_alike_and_report_no_local_scores() -> None:
    from flotilla.tasks import model_state

    task = DigitsTask()
    params = {"augment": True, "min_samples": 5, "max_samples": 90}
    whole = DataSection(params={**params, "val_fraction": 0.0})
    shards = ShardCache(task, 500)
    clients = list(range(0, 500, 50))
    for c in clients:
        kept, split = shards.get(whole, c), shards.get(DataSection(params=params), c)
        assert kept.num_val == 0 and kept.num_train == split.num_train + split.num_val
        assert shards.num_train(whole, c) == kept.num_train
    train = TrainSection(batch_size=16)
    model = model_state(task.build_model(3))
    loop = LoopTrainer(task, shards).train(model, clients, train, whole, seed=11)
    batched = BatchedTrainer(task, shards).train(model, clients, train, whole, seed=11)
    for a, b in zip(loop, batched, strict=True):
        assert set(a.metrics) == set(b.metrics) == {"train_loss", "train_accuracy"}
        for name in a.delta:
            np.testing.assert_allclose(b.delta[name], a.delta[name], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="val_fraction"):
        task.load_shard(Shard(0, 10), DataSection(params={"val_fraction": 1.0}))


class RecordingTrainer:
    """A real trainer that notes which clients each call trains, and how many updates
    the round had handed out by then."""

    def __init__(self, inner: LoopTrainer, handed_out: list[str]) -> None:
        self.inner = inner
        self.shards = inner.shards
        self.handed_out = handed_out
        self.calls: list[tuple[list[int], int]] = []

    def train(self, *args: Any, **kwargs: Any) -> list[Any]:
        self.calls.append((list(args[1]), len(self.handed_out)))
        return self.inner.train(*args, **kwargs)


def test_a_round_trains_its_clients_in_arrival_order_a_bounded_batch_at_a_time(
    tmp_path: Path,
) -> None:
    """Memory flat in clients per round: a batch's updates are handed to the engine before
    the next batch trains; updates come out as if every client had trained at once; a
    batch nobody waits for any more is not trained at all."""
    from flotilla.core.blobstore import BlobStore
    from flotilla.core.tensors import TensorSpec, encode_state
    from flotilla.core.work import WorkOrder
    from flotilla.engine.backend import Delivered, TrainTask
    from flotilla.scheduling import DevicePool, Leases
    from flotilla.simulation.backend import SimBackend
    from flotilla.simulation.fleet import Fleet
    from flotilla.tasks import model_state

    task = DigitsTask()
    task_name = "flotilla.tasks.digits:DigitsTask"
    model = model_state(task.build_model(0))
    layout = tuple(TensorSpec(n, "F32", tuple(v.shape)) for n, v in model.items())
    params = sum(v.size for v in model.values())
    handed_out: list[str] = []
    trainer = RecordingTrainer(LoopTrainer(task, ShardCache(task, 60)), handed_out)
    population = PopulationSection(clients=60, classes=(DeviceClass(speed_sigma=1.0),))

    async def run() -> tuple[list[Delivered], int]:
        leases = Leases(DevicePool(clock=asyncio.get_running_loop().time))
        devices = draw_devices(population, 3)
        fleet = Fleet(devices, (task_name,), population.availability, 3, leases)
        blobs = BlobStore(tmp_path / "blobs")
        sha = blobs.put(encode_state(model))
        backend = SimBackend(
            fleet, leases, blobs, {task_name: trainer}, population, 3, tmp_path / "state",
            deltas_in_flight_bytes=4 * params * 7,
        )  # fmt: skip
        order = WorkOrder(
            job_id="job-1", round=1, round_token="t", task=task_name, config_json="{}",
            model_sha256=sha, model_size=8, deadline=1e12, seed=5,
        )  # fmt: skip
        stream = backend.dispatch(TrainTask(order, layout), [d.device_id for d in devices])
        got = []
        async for result in stream:
            assert isinstance(result, Delivered)
            got.append(result)
            handed_out.append(result.update.device_id)
            if len(got) == 30:
                break
        await stream.aclose()
        freed = 0
        for _ in range(100):  # every device is let go, trained or not
            await asyncio.sleep(60)
            freed = sum(1 for d in devices if leases.pool.busy_with(d.device_id) is None)
            if freed == len(devices):
                break
        return got, freed

    got, freed = run_simulated(run())
    assert freed == 60
    sizes = [len(clients) for clients, _ in trainer.calls]
    # Batches 0-4 hold the 30 updates taken; 5-8 arrive after the round closed: untrained.
    assert sizes == [7] * 5, "batches of 7, and none after the 30th update"
    handed = [handed for _, handed in trainer.calls]
    assert handed == [0, 7, 14, 21, 28], "each batch was handed out before the next trained"
    trained = [c for clients, _ in trainer.calls for c in clients]
    assert len(set(trained)) == len(trained) == 35
    assert [int(r.update.device_id.split("-")[1]) for r in got] == trained[:30]
    at_once = LoopTrainer(task, ShardCache(task, 60)).train(
        model, trained[:30], TrainSection(), DataSection(), seed=5
    )
    for result, alone in zip(got, at_once, strict=True):
        for name, value in alone.delta.items():
            np.testing.assert_allclose(result.update.delta[name], value, rtol=0, atol=1e-6)


def test_every_codec_sends_a_payload_whose_size_the_layout_alone_decides() -> None:
    """The simulator times each upload before training (SimulatedUplink.payload_bytes):
    a codec whose payload grew or shrank with the values would break that."""
    from flotilla.compression import CodecContext, encode_state_with, make_codec
    from flotilla.compression.registry import CODEC_NAMES

    shapes = {"w": (300, 70), "b": (70,)}
    rng = np.random.default_rng(0)
    for name in CODEC_NAMES:
        codec = make_codec(name, {})
        sizes = {
            len(encode_state_with(codec, {k: scale * rng.standard_normal(v).astype(np.float32)
                                          for k, v in shapes.items()}, CodecContext.seeded(i)))
            for i, scale in enumerate((0.0, 1e-30, 1e-6, 1.0, 1e3))
        }  # fmt: skip
        assert len(sizes) == 1, (name, sizes)


def test_the_shard_cache_keeps_what_fits_and_loads_the_rest_when_asked() -> None:
    task = DigitsTask()
    data = DataSection(params={"augment": True, "min_samples": 50, "max_samples": 50})
    one = task.load_shard(Shard(0, 100), data)
    size = sum(t.element_size() * t.nelement() for t in (*one.train, *one.val))
    cache = ShardCache(task, 100, max_bytes=10 * size)
    first = [cache.get(data, c) for c in range(30)]
    assert all(cache.get(data, c) is first[c] for c in range(10)), "the first ten are kept"
    again = cache.get(data, 20)
    assert again is not first[20], "loaded again, not kept"
    assert np.array_equal(again.train[0].numpy(), first[20].train[0].numpy()), "the same data"
    assert [cache.num_train(data, c) for c in range(30)] == [45] * 30


def test_client_state_lives_in_a_sparse_memory_mapped_file(tmp_path: Path) -> None:
    from flotilla.core.tensors import TensorSpec
    from flotilla.simulation.client_state import ClientStateStore

    layout = (TensorSpec("w", "F32", (1000, 250)), TensorSpec("b", "F32", (250,)))
    path = tmp_path / "state.f32"
    store = ClientStateStore(path, 10_000, layout)  # 10k clients x 250k floats = 10 GB
    assert store.get(7) is None
    row = {"w": np.full((1000, 250), 0.5, np.float32), "b": np.arange(250, dtype=np.float32)}
    store.put(7, row)
    got = store.get(7)
    assert got is not None and len(store) == 1
    np.testing.assert_array_equal(got["w"], row["w"])
    np.testing.assert_array_equal(got["b"], row["b"])
    assert path.stat().st_size == 10_000 * 250_250 * 4
    assert path.stat().st_blocks * 512 < 64 * 2**20, "only written rows take disk"


# --- whole experiments ----------------------------------------------------------------------


def simulate(path: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "flotilla", "simulate", str(path), "--out", str(out), *args]
    done = subprocess.run(bound(cmd), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_simulate_writes_metrics_summary_and_plots(tmp_path: Path) -> None:
    path = experiment_file(tmp_path)
    out = tmp_path / "out"
    done = simulate(path, out, "--json", "--no-progress")
    summary = json.loads(done.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    job = summary["jobs"]["small"]
    assert job["state"] == "completed" and job["rounds"] == 4
    assert 0.0 < job["final_metrics"]["accuracy"] <= 1.0
    assert summary["final_metrics"]["accuracy"] == job["final_metrics"]["accuracy"]
    assert summary["simulated_seconds"] > 0 and summary["wall_seconds"] > 0
    metrics = rows(out)
    assert [r["round"] for r in metrics] == [1, 2, 3, 4]
    for r in metrics:
        assert {"job", "round", "simulated_time", "accuracy", "loss", "bytes_up",
                "bytes_down", "participants", "dropouts", "wall_seconds"} <= set(r)  # fmt: skip
        assert 5 <= r["participants"] <= 10
    times = [r["simulated_time"] for r in metrics]
    assert times == sorted(times)
    for name in ("accuracy_vs_time.png", "accuracy_vs_round.png", "models/small.safetensors"):
        assert (out / name).stat().st_size > 0
    assert len(rows(out, "participation.jsonl")) == sum(r["participants"] for r in metrics)


def test_same_seed_same_metrics_and_another_seed_differs(tmp_path: Path) -> None:
    path = experiment_file(tmp_path)
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run_experiment(load_experiment(path, seed=seed), tmp_path / name, progress=False)
    a, b, c = (without_wall(rows(tmp_path / n)) for n in "abc")
    assert len(a) == 4
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    ("strategy", "compression", "folds"),
    [("fedavg", "", True), ("fedprox", "", True), ("fedadam", "", True),
     ("fedavgm", "", True), ("trimmed_mean", "", False),
     ("fedavg", 'uplink = "topk"\nerror_feedback = true', False)],
)  # fmt: skip
def test_two_workers_give_the_same_result_as_one(
    tmp_path: Path, strategy: str, compression: str, folds: bool
) -> None:
    """Linear strategies fold each worker's clients where they train and agree with one
    process to float summation; a robust rule, and devices that keep state between rounds
    (error feedback), ship every delta as before."""
    body = (
        f'\n[aggregation]\nstrategy = "{strategy}"\n\n[compression]\n{compression}\n'
        "\n[simulation]\nseed = 4\n"
    )
    path = experiment_file(tmp_path, body)
    run_experiment(load_experiment(path), tmp_path / "one", progress=False)
    done = simulate(path, tmp_path / "two", "--devices", "cpu,cpu", "--json", "--no-progress")
    (trainer,) = json.loads(done.stdout)["trainer"].values()
    assert trainer.startswith("WorkerPoolTrainer"), trainer
    folded, trained = (int(n) for n in re.findall(r"(\d+) of (\d+) clients folded", trainer)[0])
    # Over-selection sends a few more devices than a round takes: those train unfolded.
    assert (folded > trained / 2) if folds else folded == 0, trainer
    one, two = without_wall(rows(tmp_path / "one")), without_wall(rows(tmp_path / "two"))
    assert [r["participants"] for r in one] == [r["participants"] for r in two]
    assert len(one) == 4
    for r1, r2 in zip(one, two, strict=True):
        # Training itself differs in the last float bits (a worker has one thread, this
        # process two), folded or not.
        assert r2["accuracy"] == pytest.approx(r1["accuracy"], abs=1e-6)
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)


def test_two_jobs_share_the_population_one_job_per_device(tmp_path: Path) -> None:
    body = """
[[jobs]]
job = { name = "a", seed = 1, clients_per_round = 25, min_quorum = 10 }

[[jobs]]
job = { name = "b", seed = 2, clients_per_round = 25, min_quorum = 10 }
"""
    path = experiment_file(tmp_path, body)
    summary = run_experiment(load_experiment(path), tmp_path / "out", progress=False)
    assert {j["state"] for j in summary["jobs"].values()} == {"completed"}
    spans: dict[str, list[tuple[float, float, str]]] = {}
    for p in rows(tmp_path / "out", "participation.jsonl"):
        spans.setdefault(p["device"], []).append((p["started_at"], p["finished_at"], p["job"]))
    assert len(spans) > 25, "together the jobs need more devices than one round takes"
    for device, items in spans.items():
        items.sort()
        for (_, end, job_a), (start, _, job_b) in itertools.pairwise(items):
            if job_a != job_b:
                assert end <= start, f"{device} served {job_a} and {job_b} at once"


def test_the_deadline_leaves_stragglers_out(tmp_path: Path) -> None:
    """Slow phones need ~100 simulated seconds a round; the deadline is 20."""
    body = """
[simulation]
seed = 1
"""
    path = experiment_file(tmp_path, body)
    experiment = load_experiment(
        path,
        [
            "job.round_deadline_s=20.0",
            "job.min_quorum=2",
            "scheduling.selector=random",  # picks slow phones too: they must be cut off
            "population.dropout=0.0",
            "population.seconds_per_sample=1.0",
        ],
    )
    summary = run_experiment(experiment, tmp_path / "out", progress=False)
    assert summary["jobs"]["small"]["rounds"] == 4
    fast = {
        d.device_id
        for d in draw_devices(experiment.population, experiment.population_seed)
        if d.kind == "server"
    }
    metrics = rows(tmp_path / "out")
    for r in metrics:
        assert r["round_seconds"] <= 20.0 + 1e-6
        assert r["participants"] < 10, "a round at its deadline commits with what it has"
    for p in rows(tmp_path / "out", "participation.jsonl"):
        assert p["device"] in fast, "no phone finishes in time"


def test_dropouts_are_recorded_and_over_selection_absorbs_them(tmp_path: Path) -> None:
    path = experiment_file(tmp_path)
    experiment = load_experiment(path, ["population.dropout=0.4", "job.over_selection=2.0"])
    run_experiment(experiment, tmp_path / "out", progress=False)
    metrics = rows(tmp_path / "out")
    assert len(metrics) == 4
    assert sum(r["dropouts"] for r in metrics) > 0
    assert sum(r["participants"] == 10 for r in metrics) >= 2, "over-selection fills rounds"
    for r in metrics:
        assert r["participants"] >= 5
        if r["participants"] < 10:
            # Too few survivors: the round waits until the dropouts are noticed, then
            # commits with its quorum.
            assert r["round_seconds"] >= 30.0


def test_compressed_uplinks_and_buffered_rounds_run_in_simulation(tmp_path: Path) -> None:
    body = """
[[jobs]]
job = { name = "plain", seed = 1 }

[[jobs]]
job = { name = "int8", seed = 1 }
compression = { uplink = "int8" }

[[jobs]]
job = { name = "topk-ef", seed = 1 }
train = { update_momentum = 0.5 }
compression = { uplink = "topk", uplink_params = { fraction = 0.05 }, error_feedback = true }

[[jobs]]
job = { name = "async", seed = 1, clients_per_round = 6, min_quorum = 1 }
aggregation = { strategy = "fedbuff", params = { buffer_size = 3 } }
"""
    path = experiment_file(tmp_path, body)
    summary = run_experiment(load_experiment(path), tmp_path / "out", progress=False)
    assert {j["state"] for j in summary["jobs"].values()} == {"completed"}
    by_job: dict[str, list[dict]] = {}
    for r in rows(tmp_path / "out"):
        by_job.setdefault(r["job"], []).append(r)
    plain = sum(r["bytes_up"] for r in by_job["plain"]) / sum(
        r["participants"] for r in by_job["plain"]
    )
    int8 = sum(r["bytes_up"] for r in by_job["int8"]) / sum(
        r["participants"] for r in by_job["int8"]
    )
    assert 3.5 < plain / int8 < 4.1
    topk = sum(r["bytes_up"] for r in by_job["topk-ef"]) / sum(
        r["participants"] for r in by_job["topk-ef"]
    )
    assert plain / topk > 5
    assert len(by_job["async"]) == 4


def test_an_experiment_file_submits_its_jobs_to_a_real_server(tmp_path: Path) -> None:
    from flotilla.core.jobfile import load_job_specs as job_specs

    body = """
[[jobs]]
job = { name = "a" }

[[jobs]]
job = { name = "b" }
"""
    specs = job_specs(experiment_file(tmp_path, body))
    assert [s.job.name for s in specs] == ["a", "b"]
    plain = job_specs(ROOT / "examples" / "digits.toml")
    assert [s.job.name for s in plain] == ["digits"]


def test_ten_thousand_clients_fit_in_memory(tmp_path: Path) -> None:
    """1,000 of 10,000 clients a round, with error feedback kept for every client."""
    import resource

    body = """
[compression]
uplink = "int8"
error_feedback = true
"""
    path = experiment_file(tmp_path, body)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    simulate(
        path, tmp_path / "out", "--clients", "10000", "--no-progress",
        "--set", "job.rounds=2", "--set", "job.clients_per_round=1000",
        "--set", "job.min_quorum=500", "--set", "job.over_selection=1.1",
    )  # fmt: skip
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    metrics = rows(tmp_path / "out")
    assert [r["round"] for r in metrics] == [1, 2]
    assert all(r["participants"] >= 900 for r in metrics)
    assert before / 1024 < 4096 and peak_mib < 4096, f"peak RSS {peak_mib:.0f} MiB"


RAY_CHECK = """
import json, sys
import numpy as np, psutil
from flotilla.core.spec import DataSection, TrainSection
from flotilla.tasks import Shard
from flotilla.tasks.digits import DigitsTask
from flotilla.core.tensors import state_spec
from flotilla.simulation.folding import FoldRequest, SliceFolder
from flotilla.simulation.ray_workers import RayTrainer
from flotilla.simulation.training import BatchedTrainer, ShardCache
from flotilla.tasks import load_task, model_state

NAME = "flotilla.tasks.digits:DigitsTask"
task = load_task(NAME)
shards = ShardCache(task, 200)
data = DataSection(params={"augment": True})
train = TrainSection(batch_size=16)
model = model_state(task.build_model(0))
clients = list(range(0, 200, 7))
trainer = RayTrainer(NAME, shards, ["cpu", "cpu"])
config = json.dumps({"train": {"batch_size": 16}, "data": {"params": {"augment": True}},
                     "compression": {}})
request = FoldRequest("job", 1, config, state_spec(model), 9, "fedavg", "{}")
try:
    remote = trainer.train(model, clients, train, data, 5)
    remote_fold = trainer.train_folded(model, clients, 5, request)
    me = psutil.Process()
    listeners = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listeners.append([proc.name(), c.laddr.ip, c.laddr.port])
        except psutil.Error:
            pass
finally:
    trainer.close()
local = BatchedTrainer(task, shards).train(model, clients, train, data, 5)
diff = max(
    float(np.abs(a.delta[k] - b.delta[k]).max()) for a, b in zip(local, remote) for k in a.delta
)
local_fold = SliceFolder(BatchedTrainer(task, shards)).fold(model, clients, 5, request)
fold_diff = max(
    float(np.abs(local_fold.partial.total[k] - remote_fold.partial.total[k]).max())
    for k in model
)
print(json.dumps({"listeners": listeners, "max_diff": diff, "count": len(remote),
                  "fold_diff": fold_diff, "folded": remote_fold.partial.count,
                  "fold_clients": [c.index for c in remote_fold.clients]}))
"""


@pytest.mark.slow
def test_ray_workers_listen_on_loopback_only_and_train_like_local_ones(tmp_path: Path) -> None:
    script = tmp_path / "ray_check.py"
    script.write_text(RAY_CHECK)
    done = subprocess.run(
        bound([sys.executable, str(script)]),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name for name, _, _ in report["listeners"]}
    assert {"gcs_server", "raylet"} <= names, report["listeners"]
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    strays = [item for item in report["listeners"] if item[1] not in loopback]
    assert not strays, f"Ray listens beyond loopback: {strays}"
    assert report["count"] == len(range(0, 200, 7))
    assert report["max_diff"] < 1e-5
    # The actors fold their slices where they train: one sum, every client, in order.
    assert report["folded"] == report["count"]
    assert report["fold_clients"] == list(range(0, 200, 7))
    assert report["fold_diff"] < 1e-3  # a sum of 29 weighted deltas, summed in two parts


async def test_one_experiment_file_trains_in_simulation_and_on_real_agents(
    in_process: InProcessFederation, tmp_path: Path
) -> None:
    """The same job spec, unchanged: 8 virtual clients, then 8 real agents (the server core
    and ``flotilla.client.Agent`` s in this process)."""
    path = tmp_path / "both.toml"
    path.write_text(
        (ROOT / "examples" / "digits.toml").read_text()
        + "\n[population]\nclients = 8\n\n[simulation]\nseed = 3\n"
    )
    experiment = load_experiment(path, ["job.rounds=20", "job.clients_per_round=4"])
    summary = await asyncio.to_thread(run_experiment, experiment, tmp_path / "sim", progress=False)
    assert summary["final_metrics"]["accuracy"] >= 0.90, summary

    await in_process.start_agents(8)
    job_id = await in_process.submit(path, "job.rounds=20", "job.clients_per_round=4")
    status = await in_process.wait_for(job_id, timeout=400)
    assert status["state"] == "completed", status
    assert status["metrics"]["accuracy"] >= 0.90, status


@pytest.mark.slow
def test_the_example_experiment_reaches_ninety_percent(tmp_path: Path) -> None:
    """`flotilla simulate examples/digits-sim.toml`: 1,000 clients, 100 a round, 30 rounds,
    20% mid-round dropout."""
    done = simulate(ROOT / "examples" / "digits-sim.toml", tmp_path / "out", "--json")
    summary = json.loads(done.stdout)
    job = summary["jobs"]["digits-sim"]
    assert job["state"] == "completed" and job["rounds"] == 30
    assert job["final_metrics"]["accuracy"] >= 0.90, summary
    metrics = rows(tmp_path / "out")
    dropped = sum(r["dropouts"] for r in metrics)
    selected = 130 * len(metrics)
    assert 0.12 < dropped / selected < 0.28, "about 20% of the selected devices drop out"


def test_devices_train_only_while_online(tmp_path: Path) -> None:
    """Exponential on/off sessions: every participation lies inside an online session of
    its device, and devices whose session ends mid-round count as dropouts."""
    body = """
[population.availability]
kind = "exponential"
mean_on_s = 60.0
mean_off_s = 60.0
"""
    path = experiment_file(tmp_path, body)
    experiment = load_experiment(path, ["population.dropout=0.0", "job.rounds=6"])
    run_experiment(experiment, tmp_path / "out", progress=False)
    metrics = rows(tmp_path / "out")
    assert len(metrics) == 6
    assert sum(r["dropouts"] for r in metrics) > 0, "sessions end mid-round"
    pop = experiment.population
    devices = {d.device_id: d for d in draw_devices(pop, experiment.population_seed)}
    for p in rows(tmp_path / "out", "participation.jsonl"):
        index = devices[p["device"]].index
        online_from = None
        for t, online in sessions(pop.availability, experiment.population_seed, index):
            if t > p["finished_at"]:
                break
            online_from = t if online else None
        assert online_from is not None and online_from <= p["started_at"], p


def test_task_parameters_send_batched_training_to_the_task_s_own_loop() -> None:
    from flotilla.tasks import model_state
    from flotilla.tasks.digits import DigitsTask

    task = DigitsTask()
    data = DataSection(params={"augment": True})
    shards = ShardCache(task, 100)
    model = model_state(task.build_model(0))
    train = TrainSection(params={"anything": 1.0})
    batched = BatchedTrainer(task, shards)
    got = batched.train(model, [1, 2], train, data, seed=3)
    want = LoopTrainer(task, shards).train(model, [1, 2], train, data, seed=3)
    for a, b in zip(want, got, strict=True):
        for name in a.delta:
            np.testing.assert_array_equal(a.delta[name], b.delta[name])
    assert batched.choice is None, "the loop ran, and no vectorized way was even tried"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["unrelated", "related"])
def test_the_scheduling_study_runs_its_three_jobs(scenario: str, tmp_path: Path) -> None:
    """The study's scenario files as benchmarks/scheduling.py runs them (fewer rounds and
    devices): every job, the char LM included, trains and reports its target metric."""
    path = ROOT / "examples" / "scheduling" / f"{scenario}.toml"
    overrides = ["job.rounds=2", "population.clients=120", "scheduling.selector=greedy"]
    summary = run_experiment(load_experiment(path, overrides), tmp_path / "out", progress=False)
    assert {name: j["state"] for name, j in summary["jobs"].items()} == {
        "wide": "completed",
        "epochs": "completed",
        "charlm": "completed",
    }
    assert 0.0 < summary["jobs"]["charlm"]["final_metrics"]["bits_per_char"] < 8.0
