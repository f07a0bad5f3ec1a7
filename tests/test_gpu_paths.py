"""The GPU paths' rules, checked where a CPU can show them: terms report on the step's device and keep
their state generically, a compiled decoder's average is its own model, the graphs' learning rate
follows the schedule, a failed capture or replay falls back to eager steps, and a run resumes on
another device.

The graphs themselves are CUDA's; here a stand-in takes their place through the same code path
(`TrainStep(graphs=...)`): it "captures" by keeping the function and "replays" by calling it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import captioner.train.parts as parts_module
from captioner.data.batches import Batch
from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.objectives import objective as objective_module
from captioner.objectives.scst import ScstConfig, SelfCritical
from captioner.objectives.terms import Context, Term
from captioner.train.averaging import WeightAverage
from captioner.train.config import TrainConfig
from captioner.train.loop import fit

SMALL = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.1)


class StandInGraphs:
    """A graph maker for the CPU: capture keeps the function, replay calls it; `fail` makes the
    capture or the replay of the n-th graph raise, as a CUDA error would."""

    def __init__(self, fail: str | None = None):
        self.fail, self.captured, self.replays = fail, 0, 0

    def supported(self, device) -> bool:
        return True

    def side(self):
        import contextlib

        return contextlib.nullcontext()

    def capture(self, fn, generators=(), *, what="a CUDA graph"):
        self.captured += 1
        if self.fail == "capture":
            raise RuntimeError("injected capture failure")
        maker = self

        class Replay:
            def replay(self):
                maker.replays += 1
                if maker.fail == "replay":
                    raise RuntimeError("injected replay failure")
                fn()

        return Replay()


def _fit(data_dir, out, monkeypatch, graphs, **settings):
    monkeypatch.setattr(parts_module, "GraphCapture", lambda device: graphs)
    cfg = TrainConfig.of(
        epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, val_images=4, log_every=1, shapes="fixed", seed=3, **settings
    )
    fit(str(data_dir), str(out), SMALL, cfg, device="cpu", progress_bar=False)
    lines = [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]
    return [x["loss"] for x in lines if x["event"] == "train"], lines


@pytest.fixture(scope="module")
def eager_losses(data_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _fit(data_dir, tmp_path_factory.mktemp("eager"), monkeypatch, None, cuda_graphs="off")[0]


@pytest.mark.parametrize(
    "fail", [pytest.param(None, marks=pytest.mark.slow), "capture", pytest.param("replay", marks=pytest.mark.slow)]
)
def test_graphed_steps_and_their_fallback_train_as_eager_steps_do(data_dir, tmp_path, monkeypatch, eager_losses, fail):
    """Replayed graphs, and graphs whose capture or replay fails (one warning naming the error and
    the shape, then eager steps for it), give the losses of a run without graphs, step for step."""
    graphs = StandInGraphs(fail)
    eager = eager_losses
    graphed, lines = _fit(data_dir, tmp_path / "graphed", monkeypatch, graphs)
    assert graphs.captured > 0
    assert graphed == pytest.approx(eager, rel=1e-5, abs=1e-6)
    warnings = [x for x in lines if x["event"] == "graph_failed"]
    if fail is None:
        assert graphs.replays > 0 and not warnings
    else:
        assert warnings and all(f"injected {fail} failure" in w["message"] for w in warnings)
        assert all("shape" in w["message"] for w in warnings)
        assert len(warnings) == graphs.captured  # each shape fails once, then stays eager


@pytest.mark.slow
def test_cuda_graphs_off_never_captures(data_dir, tmp_path, monkeypatch):
    graphs = StandInGraphs()
    _fit(data_dir, tmp_path / "run", monkeypatch, graphs, cuda_graphs="off")
    assert graphs.captured == 0


def test_a_learning_rate_set_as_a_float_reaches_the_graphs(data_dir, tmp_path, monkeypatch):
    """A schedule that assigns a float (ReduceLROnPlateau on some torch versions, a resumed run's saved
    rates) changes the tensor the captured step reads, which stays the one it captured."""
    from conftest import train_step

    from captioner.data.batches import CaptionBatches, FixedShapes
    from captioner.data.dataset import CaptionData

    data = CaptionData(str(data_dir))
    dec = AttentionDecoder(vocab_size=len(data.vocab), embed_dim=16, hidden_dim=24, attention_dim=12)
    dec.set_feature_stats(*data.feature_stats())
    step = train_step(dec, TrainConfig.of(shapes="fixed", consistency=0), graphs=StandInGraphs())
    rate = step.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(rate)
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    batch = next(iter(CaptionBatches(data, 8, fixed=fixed).batches(seed=0, epoch=0)))
    for _ in range(5):
        step(batch)
    step.optimizer.param_groups[0]["lr"] = 2.5e-4  # as a float
    step(batch)
    assert step.optimizer.param_groups[0]["lr"] is rate
    assert float(rate) == pytest.approx(2.5e-4)


def test_every_value_a_term_reports_lives_on_the_steps_device(monkeypatch):
    """SCST scores its samples on the host; what it reports beside its loss comes back to the device
    (here `meta`, which refuses to be mixed with the CPU's tensors as CUDA does)."""
    from captioner.objectives import scst

    meta = torch.device("meta")
    n, B = 2, 3

    def samples(decoder, features, n, max_len, mode, generator):  # sampled on the device, as on a GPU
        return scst.Samples(
            torch.zeros(B * n, 3, dtype=torch.long, device=meta),
            torch.zeros(B * n, dtype=torch.long, device=meta),
            torch.zeros(B * n, device=meta, requires_grad=True),
            torch.zeros(B * n, device=meta),
        )

    monkeypatch.setattr(scst, "sample_captions", samples)
    term = SelfCritical(ScstConfig(samples=n), scorer=None, max_len=4)
    monkeypatch.setattr(term, "reward", lambda tokens, words, rows: torch.rand(len(rows), dtype=torch.float64))
    decoder = AttentionDecoder(vocab_size=8, embed_dim=8, hidden_dim=8, attention_dim=8).to(meta)
    batch = type("B", (), {"rows": torch.arange(B)})()
    ctx = Context(decoder, batch, torch.zeros(B, 196, 512, device=meta), None, torch.tensor(3.0, device=meta), None)
    loss = term(ctx)
    values = {"loss": loss, **term.report()}
    assert {v.device for v in values.values()} == {meta}
    torch.stack([v.float() for v in values.values()])  # what the step does with them


def test_a_compiled_decoders_average_runs_its_own_weights(monkeypatch):
    """`fit --compile` with the average: the average's attention and LSTM step are its own (compiled),
    not wrappers still bound to the decoder being trained."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda *a, **k: fn(*a, **k))
    dec = AttentionDecoder(vocab_size=10, embed_dim=8, hidden_dim=8, attention_dim=8)
    dec.compile_step()
    average = WeightAverage(dec, 0.9)
    with torch.no_grad():
        for p in average.model.parameters():
            p.mul_(0.5)
    plain = copy.deepcopy(average.model)
    for name in ("attend", "advance"):
        plain.__dict__.pop(name, None)
    feats = torch.randn(2, 196, 512)
    h = torch.randn(2, 8)
    emb = torch.randn(2, 8)
    projected = average.model.attention.project(feats)
    got = average.model.attend(projected, h, emb, 1.0)
    want = AttentionDecoder.attend(plain, projected, h, emb, 1.0)
    assert torch.allclose(got, want)


class Counter(Term):
    """A test-only term with state: how many steps were applied."""

    name = "counter"

    def __init__(self, state):
        super().__init__(0.0)
        self.state = state.claim(self.name, applied=torch.zeros(()))

    def __call__(self, ctx):
        return torch.zeros((), device=ctx.features.device)

    def after_step(self, applied):
        self.state["applied"].add_(applied.float())


@pytest.mark.slow
def test_a_terms_state_survives_resume(data_dir, tmp_path, monkeypatch):
    """A new term with state needs only its own class and the line that adds it: the step, the loop and
    the checkpoints keep its state, and `--resume` goes on from it."""
    real = objective_module.objective_terms
    monkeypatch.setattr(objective_module, "objective_terms", lambda cfg, **kw: [*real(cfg, **kw), Counter(kw["state"])])
    monkeypatch.setattr(parts_module, "objective_terms", objective_module.objective_terms)
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, val_images=4, seed=2)
    first = fit(str(data_dir), str(tmp_path / "run"), SMALL, cfg, device="cpu", progress_bar=False)
    saved = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert float(saved["terms"]["counter"]["applied"]) == first.step
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, val_images=4, seed=2)
    second = fit(str(data_dir), str(tmp_path / "run"), SMALL, cfg, resume=True, device="cpu", progress_bar=False)
    saved = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert float(saved["terms"]["counter"]["applied"]) == second.step > first.step


def test_resume_on_another_device_reseeds_the_streams_it_cannot_map(data_dir, tmp_path):
    """A last.pt written on a GPU (a CUDA generator's state, CUDA streams) resumes on a CPU: the
    random streams that do not fit are reseeded, and the log says so."""
    run = tmp_path / "run"
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, val_images=4)
    fit(str(data_dir), str(run), SMALL, cfg, device="cpu", progress_bar=False)
    ck = load_checkpoint(str(run / "last.pt"))
    ck["rng"]["generator"] = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state
    ck["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2
    save_checkpoint(ck, str(run / "last.pt"))
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, val_images=4)
    progress = fit(str(data_dir), str(run), SMALL, cfg, resume=True, device="cpu", progress_bar=False)
    assert progress.epoch == 2
    lines = [json.loads(x) for x in open(run / "metrics.jsonl", encoding="utf-8")]
    notes = [x["message"] for x in lines if x["event"] == "rng_reseeded"]
    assert notes and "generator" in notes[0]


def test_boxes_choice_weight_with_hard_attention_is_refused(data_dir, scenes, tmp_path):
    from captioner.errors import CaptionerError

    cfg = TrainConfig.of(epochs=1, boxes_choice_weight=1.0)
    with pytest.raises(CaptionerError, match="--boxes-choice-weight"):
        fit(
            str(data_dir),
            str(tmp_path / "run"),
            DecoderConfig(0, attention="hard"),
            cfg,
            boxes=str(scenes / "boxes.json"),
            device="cpu",
            progress_bar=False,
        )


def test_fixed_tail_batches_keep_the_buckets_shapes(data_dir):
    """The last batch of an epoch has as many views as every other: no new shape to capture."""
    from captioner.data.batches import CaptionBatches, FixedShapes
    from captioner.data.dataset import CaptionData
    from captioner.train.step import _shape_key

    data = CaptionData(str(data_dir))
    fixed = FixedShapes.for_data(7, int(data.lengths.max()))
    batches = list(CaptionBatches(data, 7, view_share=0.25, fixed=fixed).batches(seed=0, epoch=0))
    assert len(data.lengths) % 7  # there is a tail
    keys = {_shape_key(b) for b in batches}
    assert len(keys) <= len(fixed.lengths)
    assert isinstance(batches[0], Batch)
