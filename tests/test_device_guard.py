"""A CPU-side guard for the GPU's class of bugs: the fixed-shape training step on the `meta` device.

A tensor on the meta device has a shape and no data, so everything that reads a value back to the
host fails on it (`.item()`, `.tolist()`, `.numpy()`, `np.asarray`, `bool()` or `float()` of a
tensor, a boolean mask that makes a shape from values), and so does an operation that mixes it
with a tensor made without its inputs' device (`torch.tensor(...)` on the CPU). The same code on a
GPU would wait for the device at every step, or fail as `fit --fine-tune-encoder` once did
(`np.asarray` on CUDA moves). It cannot see: which device a generator draws on (the draws here
use the default one), CUDA-only kernels and their limits (fused Adam, graph capture), dtypes
under autocast, or numbers. The selfcheck (`captioner selfcheck --device cuda`) runs the modes
on a real GPU.
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
from captioner.objectives.objective import Objective, objective_terms
from captioner.objectives.reinforce import HardAttentionConfig
from captioner.objectives.terms import TermsConfig
from captioner.train.averaging import WeightAverage

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


@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("boxes", [False, True])
def test_the_fixed_shape_step_never_reads_the_device(data_dir, scenes, attention, boxes):
    """Forward, backward, clipping, the average and the terms' own state (hard attention's baseline),
    with the default objective's terms (the consistency, and `--boxes`), touch no value on the host."""
    data = CaptionData(str(data_dir))
    targets = None
    if boxes:
        targets = BoxTargets(data, GroundingBoxes(str(scenes / "boxes.json")), data.encoder.preprocess, 14)
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    source = CaptionBatches(data, 8, view_share=0.25, targets=targets, fixed=fixed)
    dec = decoder_on_meta(data, attention, word_query=boxes)
    cfg = TermsConfig(alpha_c=0.3, consistency=1.0, boxes="b.json" if boxes else None)
    terms = objective_terms(
        cfg, attention=attention, hard=HardAttentionConfig(), views=True, baseline=torch.zeros((), device=META)
    )
    objective = Objective(dec, terms, shapes="fixed", semi_sampling=0.5 if attention == "hard" else None).train()
    assert objective.capturable
    average = WeightAverage(dec, 0.99)
    for batch in list(source.batches(seed=0, epoch=0))[:2]:
        batch = on_meta(batch)
        loss, values = objective(batch, batch.count)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(dec.parameters()), 5.0)
        ok = torch.isfinite(torch.stack([loss, norm, *values.values()])).all()
        average.update(dec, torch.ones((), device=META), ok)
        for term in terms:
            term.after_step(ok)
        assert loss.device == META and {"nll", "consistency"} <= set(values)


def test_a_fine_tuned_encoders_views_stay_on_the_device(data_dir):
    """The views of the images a fine-tuned encoder makes for the consistency (conv5_1 on the pool4 cache)."""
    data = CaptionData(str(data_dir))
    base, _ = build_encoder(EncoderSpec(weights="none"))
    start = start_index(base.features, "conv5_1")
    encoder = TunedEncoder(base.features, start, from_cache=True).to(META)
    dec = decoder_on_meta(data, "soft")
    terms = objective_terms(
        TermsConfig(alpha_c=0.3, consistency=1.0),
        attention="soft",
        hard=HardAttentionConfig(),
        views=True,
        baseline=torch.zeros((), device=META),
    )
    objective = Objective(dec, terms, shapes="fixed", encoder=encoder, view_share=0.5)
    batch = Batch(
        torch.randn(3, 196, 512),  # pool4 rows of 3 images
        torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0], [1, 8, 9, 2], [1, 5, 2, 0]]),
        torch.tensor([4, 3, 4, 3]),
        image_index=torch.tensor([0, 0, 1, 2]),
    )
    loss, values = objective(on_meta(batch), batch.count.to(META))
    loss.backward()
    assert values["consistency"].device == META
    assert all(p.grad is not None for p in encoder.tuned.parameters() if p.requires_grad)
