"""The familiarity statistics (`models.familiarity`) of a run's training images, and their threshold.

The training images' pooled vectors are modelled as one Gaussian; its covariance Σ is shrunk
towards a multiple of the identity, since a few thousand images cannot estimate
D² = 262,144 covariances; how much is chosen from the data (Ledoit-Wolf). The full covariance
separates scenes from photographs far better than the diagonal alone or than per-location
distances: photographs differ less in any one channel than in how
channels go together.

The threshold is calibrated on two sides. Familiar: the held-out validation images, which the
model never trained on; the QUANTILE of their scores, times MARGIN, is the least the threshold
may be. Unfamiliar: real photographs that Python packages ship (matplotlib's sample photograph,
`calibration_photos`), whole and in crops. When the
photographs all score above that least value, the threshold lies halfway between the two (the
geometric mean with the photographs' lowest score), so neither side sits on the edge; when some
do not, it stays at the validation bound, since a scene flagged as unlike its own training
scenes would be worse than a photograph missed. Statistics, threshold and the photographs'
scores are computed by `fit` and stored in the checkpoint under "familiarity" as plain tensors
and numbers (a fine-tuned encoder's checkpoints get them when `fit` ends, from the layers each
holds: `finetune.add_tuned_familiarity`).
Symbols: B images, L locations, D annotation size, N images sampled from a split.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from captioner.data.features import nonfinite_rows
from captioner.data.images import load_image
from captioner.errors import CaptionerError
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.familiarity import EPS, MARGIN, QUANTILE, FamiliarityStats, mahalanobis, pool
from captioner.models.fast_encoder import optimize_encoder

MAX_TRAIN_IMAGES = 4000  # enough for the covariance with shrinkage; bounds the reads on COCO
MAX_VAL_IMAGES = 1000


def gaussian(vectors: torch.Tensor, shrinkage: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean (D,) and precision (D, D) of vectors (N, D), the covariance shrunk towards m·I.

    Args:
        shrinkage: s in Σ ← (1 − s) S + s·m·I, m the mean variance; None picks it from the data
            (Ledoit and Wolf, 2004): near 1 for a few vectors, small for many.

    Returns:
        μ, Σ⁻¹ and the shrinkage used.
    """
    mu = vectors.mean(0)  # (D,)
    x = (vectors - mu).double()  # (N, D)
    n, D = x.shape
    cov = x.T @ x / max(1, n)  # (D, D) S
    m = cov.diagonal().mean().clamp_min(EPS**2)
    eye = torch.eye(D, dtype=cov.dtype)
    if shrinkage is None:
        # b² estimates how far S is from Σ (its sampling error), d² how far S is from m·I.
        d2 = (cov - m * eye).pow(2).sum()
        b2 = ((x.pow(2).sum(1).pow(2).sum() / n - cov.pow(2).sum()) / n).clamp_min(0)
        shrinkage = float(min(1.0, b2 / d2)) if d2 > 0 else 1.0
    cov = (1 - shrinkage) * cov + shrinkage * m * eye
    return mu, torch.linalg.inv(cov).float(), float(shrinkage)


def _sample(rows: np.ndarray, most: int, seed: int) -> np.ndarray:
    if len(rows) <= most:
        return rows
    return np.sort(np.random.default_rng(seed).choice(rows, size=most, replace=False))


def _pooled(
    read: Callable[[np.ndarray], torch.Tensor], rows: np.ndarray, mean: torch.Tensor, std: torch.Tensor, batch: int = 64
) -> torch.Tensor:
    """Pooled standardised vectors (N, D) of the features `read` gives for rows, a batch at a time.

    Rows whose features are not finite (damaged; `fit` names them) are left out quietly.
    """
    out = []
    for i in range(0, len(rows), batch):
        raw = read(rows[i : i + batch]).cpu()  # (b, L, D), fp16 if cached
        out.append(pool(raw[~torch.from_numpy(nonfinite_rows(raw.numpy()))], mean, std))
    return torch.cat(out)


def calibration_photos() -> list[str]:
    """The real photograph every install has: matplotlib's (a declared dependency).

    Only photographs the declared dependencies guarantee, so that the same training run stores
    the same threshold on every machine, whatever else happens to be installed. Gradio's sample
    photographs are left out on purpose: the tests check the verdict on them, so they must not be
    among the images the threshold was set with.
    """
    import matplotlib.cbook

    return [str(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))]


def photo_views(image: Image.Image) -> dict[str, Image.Image]:
    """A photograph whole and in five crops of half its sides (centre, four corners)."""
    w, h = image.size
    cw, ch = w // 2, h // 2
    boxes = {
        "whole": (0, 0, w, h),
        "centre": (w // 4, h // 4, w // 4 + cw, h // 4 + ch),
        "top-left": (0, 0, cw, ch),
        "top-right": (w - cw, 0, w, ch),
        "bottom-left": (0, h - ch, cw, h),
        "bottom-right": (w - cw, h - ch, w, h),
    }
    return {name: image.crop(box) for name, box in boxes.items()}


@torch.inference_mode()
def _encode_views(encoder: torch.nn.Module, spec: EncoderSpec, photos: Sequence[str]):
    """Names and annotation vectors (N, L, D) of the photographs' views."""
    names, pils = [], []
    for path in photos:
        for view, pil in photo_views(load_image(path)).items():
            names.append(f"{os.path.basename(path)}:{view}")
            pils.append(pil)
    weight = next(encoder.parameters(), None)  # none in a fused CPU encoder
    x = torch.stack([spec.preprocess(p) for p in pils]).to(
        weight.device if weight is not None else "cpu"
    )  # (N, 3, S, S)
    return tuple(names), encoder(x).float().cpu()  # (N, L, D)


@functools.lru_cache(maxsize=4)
def _photo_features(spec: EncoderSpec, photos: tuple[str, ...]) -> tuple[tuple[str, ...], torch.Tensor]:
    """The views' vectors by the spec's own encoder, run as `prepare` and the captioner run it
    (cached: one encoder pass per process)."""
    return _encode_views(optimize_encoder(build_encoder(spec)[0], image_size=spec.image_size), spec, photos)


def photo_scores(
    spec: EncoderSpec, score: Callable[[torch.Tensor], torch.Tensor], encoder: torch.nn.Module | None = None
) -> dict[str, float]:
    """Scores (`score` of their views' vectors) of the calibration photographs; empty when there are none or no
    encoder.

    The encoder is the one the features were made with: the data's spec unless `encoder` is
    given (a fine-tuned one). If the spec's cannot be built here (e.g. weights not in the
    cache), the threshold is calibrated on the scenes alone.
    """
    photos = tuple(calibration_photos())
    if not photos:
        return {}
    try:
        names, feats = _photo_features(spec, photos) if encoder is None else _encode_views(encoder, spec, photos)
    except CaptionerError:
        return {}
    return dict(zip(names, score(feats).tolist()))


def threshold(val_bound: float, photos: dict[str, float]) -> float:
    """The verdict's threshold from the validation bound and the photographs' scores (module doc)."""
    lowest = min(photos.values(), default=0.0)
    return float(np.sqrt(val_bound * lowest)) if lowest > val_bound > 0 else float(val_bound)


def fit_stats(
    data,
    *,
    seed: int = 0,
    features: Callable[[np.ndarray], torch.Tensor] | None = None,
    encoder: torch.nn.Module | None = None,
) -> FamiliarityStats | None:
    """Statistics of a prepared data directory's training features, calibrated on its val split
    and on real photographs.

    Args:
        data: a `captioner.data.CaptionData`.
        seed: which images are sampled when a split has more than MAX_TRAIN_IMAGES / MAX_VAL_IMAGES.
        features, encoder: a fine-tuned encoder's features of cache rows (rows → (n, L, D)) and
            that encoder for the photographs; default: the feature cache and the data's encoder.

    Returns:
        The stats, or None when the data has no training or no validation images.
    """
    if any(len(data.images.get(split, ())) == 0 for split in ("train", "val")):
        return None  # nothing to learn from, or nothing to calibrate on
    read = features or (lambda rows: torch.from_numpy(data.cache[rows]))
    _, train_rows = data.split_images("train")
    _, val_rows = data.split_images("val")
    mean, std = data.feature_stats()
    std = std.clamp_min(EPS)
    train = _pooled(read, _sample(np.asarray(train_rows), MAX_TRAIN_IMAGES, seed), mean, std)  # (N, D)
    mu, precision, shrinkage = gaussian(train)
    val = mahalanobis(_pooled(read, _sample(np.asarray(val_rows), MAX_VAL_IMAGES, seed), mean, std), mu, precision)
    quantile = float(torch.quantile(val, QUANTILE))
    photo = photo_scores(data.encoder, lambda feats: mahalanobis(pool(feats, mean, std), mu, precision), encoder)
    return FamiliarityStats(
        mean,
        std,
        mu,
        precision,
        threshold=threshold(MARGIN * quantile, photo),
        train_images=len(train),
        val_images=len(val),
        val_quantile=quantile,
        shrinkage=shrinkage,
        photo_scores=photo,
    )
