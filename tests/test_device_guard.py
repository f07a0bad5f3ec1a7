"""A CPU-side guard for the GPU's class of bugs: the fixed-shape training step on the `meta` device.

A tensor on the meta device has a shape and no data, so everything that reads a value back to the
host fails on it (`.item()`, `.tolist()`, `.numpy()`, `np.asarray`, `bool()` or `float()` of a
tensor, a boolean mask that makes a shape from values), and so does an operation that mixes it
with a tensor made without its inputs' device (`torch.tensor(...)` on the CPU). The same code on a
GPU would wait for the device at every step, or fail as `fit --fine-tune-encoder` once did
(`np.asarray` on CUDA moves). It cannot see: which device a generator draws on (the draws here
use the default one), CUDA-only kernels and their limits (fused Adam, CUDA graphs), dtypes
under autocast (the meta device has no autocast), or numbers. SCST is not here: it samples and
scores its captions on the host on purpose (its term is not capturable); that what it reports
comes back to the device is tests/test_gpu_paths.py's. The selfcheck (`captioner selfcheck
--device cuda`) runs every mode on a real GPU.
"""

from __future__ import annotations

import pytest
import torch

from captioner.data.batches import Batch, CaptionBatches, FixedShapes
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.tuned import TunedEncoder, start_index
from captioner.objectives.objective import HardAttentionConfig, Objective, objective_terms
from captioner.objectives.terms import TermsConfig, TermState
from captioner.train.checkpoints import Live
from captioner.train.config import OptimConfig
from captioner.train.distributed import Dist, Process
from captioner.train.step import TrainStep, WeightAverage

META = torch.device("meta")


def on_meta(batch: Batch) -> Batch:
    return batch.to(META)


def decoder_on_meta(data: CaptionData, attention: str, word_query: bool = False) -> AttentionDecoder:
    dec = AttentionDecoder(
        vocab_size=len(data.vocab),
        embed_dim=16,
        hidden_dim=24,
        attention_dim=12,
        attention=attention,
        word_query=word_query,
        dropout=0.1,
    )
    dec.set_feature_stats(*data.feature_stats())
    return dec.to(META)


class StandInOptimizer(torch.optim.Optimizer):
    """A gradient step in plain tensor ops (fused Adam has no meta kernel), not applied where the step
    set `found_inf`, as fused Adam does."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        keep = 1 - self.found_inf  # () on the device
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * keep * p.grad)


def meta_step(objective, decoder: AttentionDecoder, params, average: bool = True) -> TrainStep:
    """`fit`'s step on the meta device, with a stand-in for fused Adam (which the meta device lacks)."""
    # generator None: the default generator, as the meta device draws from no other
    live = Live(
        decoder, WeightAverage(decoder, 0.99) if average else None, None, StandInOptimizer(params), None, None, None
    )
    return TrainStep(objective, live, OptimConfig(), Process(Dist(), META))


# attention, TermsConfig fields (and "boxes": `fit --boxes`): the modes `captioner selfcheck` trains on cached
# features whose step compiles whole (--boxes-choice-weight looks its words up on the host, on purpose, so its
# step does not compile)
MODES = {
    "soft": ("soft", {}),
    "hard": ("hard", {}),
    "paper": ("soft", {"alpha_c": 1.0, "consistency": 0.0}),
    "boxes": ("soft", {"boxes": True}),
    "hard-boxes": ("hard", {"boxes": True}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_fixed_shape_step_never_reads_the_device(data_dir, scenes, mode):
    """`TrainStep`'s step with the shapes a GPU compiles (forward, backward, clipping, the optimizer's step,
    the average, the terms' own state and the sums) touches no value on the host. (The compiled forward
    itself cannot: the compiler refuses a host read where it compiles whole, `tests/test_compiled.py`.)"""
    attention, fields = MODES[mode][0], dict(MODES[mode][1])
    data = CaptionData(str(data_dir))
    boxes = fields.pop("boxes", False)
    targets = (
        BoxTargets(data, GroundingBoxes(str(scenes / "boxes.json")), data.encoder.preprocess, 14) if boxes else None
    )
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    source = CaptionBatches(data, 8, view_share=0.25, targets=targets, fixed=fixed)
    dec = decoder_on_meta(data, attention, word_query=boxes)
    cfg = TermsConfig(**{"alpha_c": 0.3, "consistency": 1.0, **fields})
    terms = objective_terms(
        cfg, attention=attention, hard=HardAttentionConfig(), views=True, state=TermState(META), targets=targets
    )
    objective = Objective(dec, terms, shapes="fixed", semi_sampling=0.5 if attention == "hard" else None)
    assert objective.capturable
    step = meta_step(objective, dec, dec.parameters())
    for batch in list(source.batches(seed=0, epoch=0))[:2]:
        step(on_meta(batch))
    assert {t.device for t in step.sums.values()} == {META}
    assert {"loss", "nll", "grad_norm"} <= set(step.sums)


@pytest.mark.parametrize("start", ["conv5_1", "conv4_1"])
def test_a_fine_tuned_encoders_step_stays_on_the_device(data_dir, start):
    """The step of `fit --fine-tune-encoder` (its encoder's views for the consistency included)."""
    data = CaptionData(str(data_dir))
    base, _ = build_encoder(EncoderSpec(weights="none"))
    from_cache = start == "conv5_1"
    first = start_index(base.features, start, "vgg16")
    encoder = TunedEncoder(base.features, first, from_cache=from_cache, arch="vgg16").to(META)
    dec = decoder_on_meta(data, "soft")
    terms = objective_terms(
        TermsConfig(alpha_c=0.3, consistency=1.0), attention="soft", hard=HardAttentionConfig(), views=True,
        state=TermState(META),
    )  # fmt: skip
    objective = Objective(dec, terms, shapes="fixed", encoder=encoder, view_share=0.5)
    inputs = torch.randn(3, 196, 512) if from_cache else torch.randn(3, 3, 224, 224)  # pool4 rows, or images
    batch = Batch(
        inputs,
        torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0], [1, 8, 9, 2], [1, 5, 2, 0]]),
        torch.tensor([4, 3, 4, 3]),
        image_index=torch.tensor([0, 0, 1, 2]),
    )
    params = [*dec.parameters(), *(p for p in encoder.parameters() if p.requires_grad)]
    step = meta_step(objective, dec, params)
    step(on_meta(batch))
    assert step.sums["consistency"].device == META


def test_a_read_of_the_device_inside_the_step_fails_the_guard(data_dir, monkeypatch):
    """The guard sees a host read added to the step: an `.item()` inside the step fails it."""
    data = CaptionData(str(data_dir))
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    batch = on_meta(next(iter(CaptionBatches(data, 8, fixed=fixed).batches(seed=0, epoch=0))))
    dec = decoder_on_meta(data, "soft")
    terms = objective_terms(TermsConfig(alpha_c=0.3, consistency=0.0), attention="soft", hard=HardAttentionConfig(),
                            views=False, state=TermState(META))  # fmt: skip
    step = meta_step(Objective(dec, terms, shapes="fixed"), dec, dec.parameters())
    real = step._update
    monkeypatch.setattr(step, "_update", lambda values: (values["loss"].item(), real(values)))
    with pytest.raises((RuntimeError, NotImplementedError)):
        step(batch)
