"""Is an image like the ones the model was trained on? A distance of its features from theirs, and how a run fits it.

A captioning model describes anything in the words it knows: shown a photograph, a model trained on coloured shapes
still writes "a red circle". These statistics say when an image is unlike the training images, so that a caption can
say so.

The score: an image's annotation vectors, standardised per channel, are averaged over locations into one D-vector x; the
training images' vectors are modelled as one Gaussian (μ, Σ shrunk towards a multiple of the identity), and the score is
sqrt((x − μ)ᵀ Σ⁻¹ (x − μ) / D). Σ is shrunk (Ledoit-Wolf) since a few thousand images cannot estimate D² = 262,144
covariances; the full covariance separates scenes from photographs far better than the diagonal: photographs differ less
in any one channel than in how channels go together.

The threshold is at least MARGIN times the QUANTILE of the held-out validation images' scores; when real photographs
(`calibration_photos`, whole and cropped) all score above that, it is the geometric mean of the two, else it stays
there: a scene flagged as unlike its own training scenes is worse than a photograph missed. `prepare` stores the
photographs' views as its encoder reads them (`PHOTOS`), so that `fit` needs no encoder and stores the same threshold
wherever it runs. Symbols: B images, L locations, D annotation size, N images sampled from a split.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from captioner.data.dataset import nonfinite_rows
from captioner.data.images import load_image
from captioner.errors import CaptionerError
from captioner.io import atomic_path
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.fast_encoder import optimize_encoder

METHOD = "pooled-mahalanobis/1"
QUANTILE = 0.99  # of the held-out images' scores ...
MARGIN = 1.0  # ... times this is the least threshold
EPS = 1e-3  # floor on stds, as the decoder's standardisation has


@dataclass
class FamiliarityStats:
    """What `distances` needs: the training features' statistics and the calibrated threshold."""

    feature_mean: torch.Tensor  # (D,) per-channel mean of the training annotation vectors
    feature_std: torch.Tensor  # (D,)
    pooled_mean: torch.Tensor  # (D,) μ of the training images' pooled standardised vectors
    precision: torch.Tensor  # (D, D) Σ⁻¹ of the shrunk covariance
    threshold: float  # scores above it are unfamiliar
    train_images: int = 0
    val_images: int = 0
    val_quantile: float = 0.0  # the QUANTILE of the held-out scores
    shrinkage: float = 0.0  # of the covariance (see `gaussian`)
    photo_scores: dict = field(default_factory=dict)  # calibration photograph (view) → score

    def to_dict(self) -> dict:
        """Plain tensors and numbers, for a checkpoint read with weights_only."""
        return {
            "method": METHOD,
            "feature_mean": self.feature_mean,
            "feature_std": self.feature_std,
            "pooled_mean": self.pooled_mean,
            "precision": self.precision,
            "threshold": float(self.threshold),
            "train_images": int(self.train_images),
            "val_images": int(self.val_images),
            "val_quantile": float(self.val_quantile),
            "quantile": QUANTILE,
            "margin": MARGIN,
            "shrinkage": float(self.shrinkage),
            "photo_scores": {str(k): float(v) for k, v in self.photo_scores.items()},
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> FamiliarityStats | None:
        """The stats of a checkpoint's "familiarity" entry; None when absent or of another method."""
        if not isinstance(d, dict) or d.get("method") != METHOD:
            return None
        return cls(
            *(d[k].float().cpu() for k in ("feature_mean", "feature_std", "pooled_mean", "precision")),
            threshold=float(d["threshold"]),
            train_images=int(d.get("train_images", 0)),
            val_images=int(d.get("val_images", 0)),
            val_quantile=float(d.get("val_quantile", 0.0)),
            shrinkage=float(d.get("shrinkage", 0.0)),
            photo_scores={str(k): float(v) for k, v in (d.get("photo_scores") or {}).items()},
        )


def pool(features: torch.Tensor, feature_mean: torch.Tensor, feature_std: torch.Tensor) -> torch.Tensor:
    """Standardised, averaged over locations: (B, L, D) → (B, D)."""
    z = (features.float() - feature_mean.to(features.device)) / feature_std.to(features.device).clamp_min(EPS)
    return z.mean(dim=1)  # (B, D)


def mahalanobis(x: torch.Tensor, mu: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """sqrt((x − μ)ᵀ P (x − μ) / D) for vectors x (B, D): about 1 for typical training vectors."""
    d = x - mu.to(x.device)  # (B, D)
    return ((d @ precision.to(x.device)) * d).sum(1).div(d.shape[1]).clamp_min(0).sqrt()  # (B,)


def distances(features: torch.Tensor, stats: FamiliarityStats) -> torch.Tensor:
    return mahalanobis(pool(features, stats.feature_mean, stats.feature_std), stats.pooled_mean, stats.precision)


def describe(score: float, stats: FamiliarityStats) -> dict:
    """The verdict on one score, as shown next to a caption: {"score", "unfamiliar", "message", "threshold"}."""
    unfamiliar = bool(score > stats.threshold)
    if unfamiliar:
        message = (
            f"This image is unlike the images the model was trained on (distance {score:.2f}; "
            f"images like them score below {stats.threshold:.2f}), so the caption is probably wrong."
        )
    else:
        message = (
            f"This image is like the images the model was trained on (distance {score:.2f}, "
            f"below {stats.threshold:.2f})."
        )
    return {
        "score": round(float(score), 4),
        "unfamiliar": unfamiliar,
        "message": message,
        "threshold": round(float(stats.threshold), 4),
    }


def familiarity(features: torch.Tensor, stats: FamiliarityStats | None) -> list[dict | None]:
    """One verdict per image; Nones when the checkpoint has no statistics."""
    if stats is None:
        return [None] * len(features)
    return [describe(s, stats) for s in distances(features, stats).tolist()]


MAX_TRAIN_IMAGES = 4000  # enough for the covariance with shrinkage; bounds the reads on COCO
MAX_VAL_IMAGES = 1000
PHOTOS = "photo_features.npz"  # in a data directory: the calibration photographs' views, by its encoder


def gaussian(vectors: torch.Tensor, shrinkage: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean (D,) and precision (D, D) of vectors (N, D), the covariance shrunk as Σ ← (1 − s) S + s·m·I, m the
    mean variance; `shrinkage` s, or None to pick it from the data (Ledoit and Wolf, 2004). Returns μ, Σ⁻¹ and s."""
    mu = vectors.mean(0)  # (D,)
    x = (vectors - mu).double()  # (N, D)
    n, D = x.shape
    cov = x.T @ x / max(1, n)  # (D, D) S
    spread = cov.diagonal().mean()
    m = spread.clamp_min(EPS**2)
    eye = torch.eye(D, dtype=cov.dtype)
    if shrinkage is None:
        # b² estimates how far S is from Σ (its sampling error), d² how far S is from m·I.
        d2 = (cov - m * eye).pow(2).sum()
        b2 = ((x.pow(2).sum(1).pow(2).sum() / n - cov.pow(2).sum()) / n).clamp_min(0)
        shrinkage = float(min(1.0, b2 / d2)) if d2 > 0 and spread > EPS**2 else 1.0  # else every vector alike
    cov = (1 - shrinkage) * cov + shrinkage * m * eye
    return mu, torch.linalg.inv(cov).float(), float(shrinkage)


def _sample(rows: np.ndarray, most: int, seed: int) -> np.ndarray:
    if len(rows) <= most:
        return rows
    return np.sort(np.random.default_rng(seed).choice(rows, size=most, replace=False))


def _pooled(
    read: Callable[[np.ndarray], torch.Tensor], rows: np.ndarray, mean: torch.Tensor, std: torch.Tensor, batch: int = 64
) -> torch.Tensor:
    """Pooled standardised vectors (N, D) of rows' features; non-finite (damaged) rows are left out quietly."""
    out = []
    for i in range(0, len(rows), batch):
        raw = read(rows[i : i + batch]).cpu()  # (b, L, D), fp16 if cached
        out.append(pool(raw[~torch.from_numpy(nonfinite_rows(raw.numpy()))], mean, std))
    return torch.cat(out)


def calibration_photos() -> list[str]:
    """The real photograph every install has: matplotlib's (a declared dependency), so that a run stores the same
    threshold on every machine. Gradio's samples are left out on purpose: the tests check the verdict on them."""
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


def save_photo_features(data_dir: str, encoder: torch.nn.Module, spec: EncoderSpec) -> None:
    """Store the calibration photographs' views as `encoder` (the data's, run as the captioner runs it) reads them."""
    names, feats = _encode_views(encoder, spec, tuple(calibration_photos()))
    with atomic_path(os.path.join(data_dir, PHOTOS)) as tmp:
        np.savez(tmp, names=np.asarray(names), features=feats.numpy())


def photo_scores(data, score: Callable[[torch.Tensor], torch.Tensor], encoder: torch.nn.Module | None = None):
    """Scores of the calibration photographs' views (name → score) by `encoder` (a fine-tuned one) or as `prepare`
    stored them; empty when neither they nor the data's encoder are here (weights not cached): the threshold then
    rests on the scenes alone."""
    stored, spec = os.path.join(data.dir, PHOTOS), data.encoder
    try:
        if encoder is None and os.path.exists(stored):
            with np.load(stored) as f:
                names, feats = f["names"].tolist(), torch.from_numpy(f["features"])
        else:  # a fine-tuned encoder's, or a directory prepared before `PHOTOS`: its encoder as the captioner runs it
            if encoder is None:
                encoder = optimize_encoder(build_encoder(spec)[0], image_size=spec.image_size)
            names, feats = _encode_views(encoder, spec, tuple(calibration_photos()))
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
    """Statistics of a prepared `CaptionData`'s training features, calibrated on its val split and on real
    photographs; None without training or validation images. `features`, `encoder`: a fine-tuned encoder's features
    of cache rows (rows → (n, L, D)) and that encoder, instead of the feature cache and the data's encoder."""
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
    photo = photo_scores(data, lambda feats: mahalanobis(pool(feats, mean, std), mu, precision), encoder)
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
