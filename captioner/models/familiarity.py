"""Is an image like the ones the model was trained on? A distance of its features from theirs.

A captioning model describes anything in the words it knows: shown a photograph, a model
trained on coloured shapes still writes "a red circle". These statistics say when an image is
unlike the training images, so that a caption can say so.

The score: an image's annotation vectors, standardised per channel, are averaged over locations into one D-vector x; the
training images' vectors are modelled as one Gaussian (μ, Σ shrunk towards a multiple of the identity), and the score is
sqrt((x − μ)ᵀ Σ⁻¹ (x − μ) / D). Symbols: B images, L locations, D annotation size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
