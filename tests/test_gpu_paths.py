"""The GPU paths' rules, checked where a CPU can show them: terms report on the step's device and keep
their state generically, fixed-shape batches keep their bucket's shapes, and a run resumes on another
device. The compiled step and search: tests/test_compiled.py.
"""

from __future__ import annotations

import json

import pytest
import torch

import captioner.train.setup as train_setup
from captioner.data.batches import Batch
from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.objectives import objective as objective_module
from captioner.objectives.scst import ScstConfig, SelfCritical
from captioner.objectives.terms import Context, Term
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit

SMALL = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.1)


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
    monkeypatch.setattr(train_setup, "objective_terms", objective_module.objective_terms)
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, val_images=4, seed=2)
    first = fit(FitJob(str(data_dir), str(tmp_path / "run"), SMALL, cfg, device="cpu", progress_bar=False))
    saved = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert float(saved["terms"]["counter"]["applied"]) == first.step
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, val_images=4, seed=2)
    second = fit(
        FitJob(str(data_dir), str(tmp_path / "run"), SMALL, cfg, resume=True, device="cpu", progress_bar=False)
    )
    saved = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert float(saved["terms"]["counter"]["applied"]) == second.step > first.step


def test_resume_on_another_device_reseeds_the_streams_it_cannot_map(data_dir, tmp_path):
    """A last.pt written on a GPU (a CUDA generator's state, CUDA streams) resumes on a CPU: the
    random streams that do not fit are reseeded, and the log says so."""
    run = tmp_path / "run"
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, val_images=4)
    fit(FitJob(str(data_dir), str(run), SMALL, cfg, device="cpu", progress_bar=False))
    ck = load_checkpoint(str(run / "last.pt"))
    ck["rng"]["generator"] = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state
    ck["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 2
    save_checkpoint(ck, str(run / "last.pt"))
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, val_images=4)
    progress = fit(FitJob(str(data_dir), str(run), SMALL, cfg, resume=True, device="cpu", progress_bar=False))
    assert progress.epoch == 2
    lines = [json.loads(x) for x in open(run / "metrics.jsonl", encoding="utf-8")]
    notes = [x["message"] for x in lines if x["event"] == "rng_reseeded"]
    assert notes and "generator" in notes[0]


def test_boxes_choice_weight_with_hard_attention_is_refused(data_dir, scenes, tmp_path):
    from captioner.errors import CaptionerError

    cfg = TrainConfig.of(epochs=1, boxes_choice_weight=1.0)
    with pytest.raises(CaptionerError, match="--boxes-choice-weight"):
        fit(
            FitJob(
                str(data_dir),
                str(tmp_path / "run"),
                DecoderConfig(0, attention="hard"),
                cfg,
                boxes=str(scenes / "boxes.json"),
                device="cpu",
                progress_bar=False,
            )
        )


def test_fixed_tail_batches_keep_the_buckets_shapes(data_dir):
    """The last batch of an epoch has as many views as every other: no new shape to compile."""
    from captioner.data.batches import CaptionBatches, FixedShapes
    from captioner.data.dataset import CaptionData

    data = CaptionData(str(data_dir))
    fixed = FixedShapes.for_data(7, int(data.lengths.max()))
    batches = list(CaptionBatches(data, 7, view_share=0.25, fixed=fixed).batches(seed=0, epoch=0))
    assert len(data.lengths) % 7  # there is a tail
    keys = {tuple(tuple(v.shape) for v in vars(b).values() if torch.is_tensor(v)) for b in batches}
    assert len(keys) <= len(fixed.lengths)
    assert isinstance(batches[0], Batch)
