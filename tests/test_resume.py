"""`fit --resume` puts a run's state back as this run holds it (`train.resume`): each rank's own
random streams, this run's optimizer flags and learning-rate objects, and no GPU entered to seed one."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed

from captioner.models.checkpoint import load_checkpoint
from captioner.objectives.terms import TermState
from captioner.train import log
from captioner.train.checkpoints import Checkpoints, Live
from captioner.train.config import Progress
from captioner.train.resume import restore

# What every checkpoint says of its run: here, nothing the streams depend on.
RECORD = dict(decoder={}, vocab=[], encoder={}, max_len=5, data=None, familiarity=None, command="", train=None)


# helpers


def run(seed: int, optimizer=None) -> Live:
    """A tiny run's live objects on the CPU, its terms' generator seeded `seed` (`Trainer`: seed + 1 + rank)."""
    decoder = torch.nn.Linear(3, 2)
    optimizer = (optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3)))(list(decoder.parameters()))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max")
    generator = torch.Generator().manual_seed(seed)
    return Live(decoder, None, None, optimizer, scheduler, generator, TermState("cpu"))


def saved(live: Live, step: int, **rng) -> dict:
    """What `restore` reads of a checkpoint of `live` at `step` (one process: rank 0's streams)."""
    streams = {"torch": torch.get_rng_state(), "generator": live.generator.get_state(), "cuda": []}
    return {
        "model": live.decoder.state_dict(),
        "optimizer": live.optimizer.state_dict(),
        "scheduler": live.scheduler.state_dict(),
        "progress": asdict(Progress(step=step)),
        "rng": {**streams, **rng},
    }


def as_rank(monkeypatch, rank: int, world: int) -> None:
    """This process is rank `rank` of a torchrun job of `world` processes."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)


def resumed(tmp_path, monkeypatch, rank: int, world: int, ck: dict) -> tuple[Live, list[dict]]:
    """A fresh run of rank `rank` resumed from `ck`, with the notes it logged."""
    as_rank(monkeypatch, rank, world)
    torch.manual_seed(12345)  # a fresh process's own stream, which the resume must replace
    live, notes = run(seed=999), []
    restore(live, ck, str(tmp_path), log.FaultLog(notes.append, show=False))
    return live, notes


def reseeded(notes: list[dict]) -> list[str]:
    return [n["message"] for n in notes if n["event"] == "rng_reseeded"]


# each rank's random streams


def test_each_rank_resumes_its_own_random_streams(tmp_path, monkeypatch):
    """Rank 0 alone writes last.pt; each rank resumes with the streams it had when it was saved,
    distinct from the other's, as an uninterrupted run goes on with them."""
    ranks = {rank: run(seed=1 + rank) for rank in (1, 0)}
    streams = {}
    for rank, live in ranks.items():  # every rank saves at the same step; rank 1 first
        as_rank(monkeypatch, rank, 2)
        torch.manual_seed(100 + rank)
        torch.rand(3, generator=live.generator)
        streams[rank] = (torch.get_rng_state(), live.generator.get_state())
        notes = log.FaultLog(lambda record: None, show=False)
        checkpoints = Checkpoints(str(tmp_path), main=rank == 0, live=live, record=RECORD, notes=notes)
        checkpoints.save(checkpoints.last_path, Progress(step=7), {})
    assert not torch.equal(streams[0][1], streams[1][1])
    for rank in (0, 1):
        live, notes = resumed(tmp_path, monkeypatch, rank, 2, load_checkpoint(str(tmp_path / "last.pt")))
        assert torch.equal(torch.get_rng_state(), streams[rank][0]), rank
        assert torch.equal(live.generator.get_state(), streams[rank][1]), rank
        assert not reseeded(notes)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_resumed_by_another_number_of_processes_each_rank_is_reseeded_apart(tmp_path, monkeypatch, rank):
    """Saved by 2 processes, resumed by 3: no rank's saved streams fit, so each rank's are reseeded from
    (seed, rank, step), apart from the others' and the same at each resume, and the log says so."""
    ck = saved(run(seed=1), step=7, world=2)
    draws = {}
    for r in (rank, (rank + 1) % 3, rank):
        live, notes = resumed(tmp_path, monkeypatch, r, 3, {**ck, "rng": dict(ck["rng"])})
        draws.setdefault(r, []).append(torch.rand(4, generator=live.generator).tolist() + torch.rand(4).tolist())
        assert reseeded(notes) and "2 processes" in reseeded(notes)[0]
    assert draws[rank][0] == draws[rank][1]  # deterministic
    assert draws[rank][0] != draws[(rank + 1) % 3][0]  # apart


def test_a_checkpoint_without_each_ranks_streams_reseeds_the_other_ranks(tmp_path, monkeypatch):
    """A last.pt from before each rank saved its own streams: rank 0 resumes with the saved ones, as
    before; rank 1, whose own were never saved, gets streams of its own, not rank 0's, with a note."""
    ck = saved(run(seed=1), step=7)
    first, notes = resumed(tmp_path, monkeypatch, 0, 2, ck)
    assert torch.equal(first.generator.get_state(), ck["rng"]["generator"]) and not reseeded(notes)
    other, notes = resumed(tmp_path, monkeypatch, 1, 2, ck)
    assert not torch.equal(other.generator.get_state(), ck["rng"]["generator"])
    assert not torch.equal(torch.get_rng_state(), ck["rng"]["torch"])
    assert reseeded(notes)


# the optimizer


def test_a_resumed_optimizer_keeps_this_runs_flags_and_learning_rate_tensors():
    """Saved on a CPU (a float rate, fused, not capturable), resumed as on a GPU (a tensor rate that CUDA
    graphs read, capturable): the saved moments and rate, in this run's flags and rate tensor."""
    before = run(seed=1, optimizer=lambda params: torch.optim.Adam(params, lr=3e-3, fused=True))
    before.decoder(torch.randn(4, 3)).sum().backward()
    before.optimizer.step()
    before.optimizer.param_groups[0]["lr"] = 1.5e-3  # as the plateau schedule leaves it
    ck = saved(before, step=1)
    rate = torch.tensor(3e-3)
    after = run(seed=1, optimizer=lambda params: torch.optim.Adam(params, lr=rate, capturable=True, foreach=False))
    restore(after, ck, "unused", log.FaultLog(lambda record: None, show=False))
    group = after.optimizer.param_groups[0]
    assert group["lr"] is rate and float(rate) == pytest.approx(1.5e-3)
    assert (group["capturable"], group["fused"], group["foreach"]) == (True, None, False)
    for i, p in enumerate(after.decoder.parameters()):
        assert torch.equal(after.optimizer.state[p]["exp_avg"], ck["optimizer"]["state"][i]["exp_avg"])


def test_a_cooldown_rate_is_put_back_into_this_runs_rate_tensor():
    """A run saved during its cooldown starts the next from the rate it cooled from, in the same tensor."""
    ck = saved(run(seed=1), step=3)
    ck["progress"]["cooldown_from"] = [2e-3]
    rate = torch.tensor(1e-3)
    after = run(seed=1, optimizer=lambda params: torch.optim.Adam(params, lr=rate, capturable=True, foreach=False))
    progress = restore(after, ck, "unused", log.FaultLog(lambda record: None, show=False))
    assert after.optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(2e-3)
    assert progress.cooldown_from is None


# the GPUs' streams


def test_cuda_streams_are_set_without_entering_any_device(monkeypatch):
    """Three GPUs, one saved stream: each GPU's generator is set or reseeded by name; entering a device
    (`torch.cuda.device`) would open a CUDA context on every GPU of the machine."""
    gpus = tuple(torch.Generator().manual_seed(50 + i) for i in range(3))  # stand-ins for the GPUs' generators
    fresh = [g.get_state() for g in gpus]

    def entered(*args, **kwargs):
        raise AssertionError("a device was entered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "default_generators", gpus)
    monkeypatch.setattr(torch.cuda, "device", entered)
    monkeypatch.setattr(torch.cuda, "manual_seed", entered)  # seeds the current device: names none
    one = torch.Generator().manual_seed(7).get_state()
    notes = []
    restore(run(seed=1), saved(run(seed=1), step=4, cuda=[one]), "unused", log.FaultLog(notes.append))
    assert torch.equal(gpus[0].get_state(), one)
    assert all(not torch.equal(gpus[i].get_state(), fresh[i]) for i in (1, 2))
    assert "CUDA" in reseeded(notes)[0]


def test_a_resumed_run_is_given_its_boxes_again_and_records_where_it_started(small_run, data_dir, tmp_path):
    """The files a run read (`fit --init`, `--boxes`) are arguments, like --data: a resumed run is given its
    boxes again, and its checkpoints record both beside the data."""
    from captioner.data.dataset import CaptionData
    from captioner.errors import CaptionerError
    from captioner.models.checkpoint import save_checkpoint
    from captioner.train.resume import start_from
    from captioner.train.trainer import FitJob

    data, cpu = CaptionData(str(data_dir)), torch.device("cpu")
    ck = load_checkpoint(str(small_run / "last.pt"))
    assert (ck["data"]["init"], ck["data"]["boxes"]) == (None, None)
    with pytest.raises(CaptionerError, match="trained without --boxes"):
        start_from(FitJob(str(data_dir), str(small_run), resume=True, boxes="boxes.json"), data, cpu)
    boxed = tmp_path / "boxed"
    boxed.mkdir()
    save_checkpoint({**ck, "data": {**ck["data"], "boxes": "scenes/boxes.json"}}, str(boxed / "last.pt"))
    with pytest.raises(CaptionerError, match="trained with --boxes scenes/boxes.json: pass it again"):
        start_from(FitJob(str(data_dir), str(boxed), resume=True, command="python train.py fit --resume"), data, cpu)
    _, saved, began = start_from(
        FitJob(str(data_dir), str(boxed), resume=True, boxes="scenes/boxes.json", command="again"), data, cpu
    )
    assert saved["step"] == ck["step"] and began == {"init": None, "boxes": "scenes/boxes.json", "command": None}
