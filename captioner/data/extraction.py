"""Filling the feature cache: images decoded by DataLoader workers, encoded in batches, stored.

Shapes: b images in a batch, S the encoder's input side, L locations, D feature size.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.dataset import FeatureCache
from captioner.data.images import load_image
from captioner.errors import CaptionerError, ImageError
from captioner.models.preprocess import Preprocess


def _leave_signals_to_the_main_process(worker_id: int) -> None:
    # Ctrl-C reaches the whole process group: workers ignore it and SIGTERM, so that the main
    # process can finish its batch (GracefulStop) instead of losing its workers under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ImageFiles(Dataset):
    """The images of cache `rows` (`paths[row]`), preprocessed in DataLoader workers; a bad one yields its message."""

    def __init__(self, paths: Sequence[str], rows: np.ndarray, preprocess: Preprocess):
        self.paths, self.rows, self.preprocess = paths, rows, preprocess

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        row = int(self.rows[i])
        size = self.preprocess.size
        try:
            return row, self.preprocess(load_image(self.paths[row])), ""
        except ImageError as e:
            return row, torch.zeros(3, size, size), str(e)


def _encode(encoder, images: torch.Tensor, batch_rows: torch.Tensor, ok: list[int], n: int, device: str, transform):
    """The features of a batch's readable images, on their way to the host (see `_to_host`)."""
    x = images if len(ok) == n else images[ok]  # indexing would copy the pinned batch
    x = x.to(device, non_blocking=True)  # (b, 3, S, S)
    x = x if transform is None else transform(x, batch_rows[ok].numpy())
    return _to_host(encoder(x).float(), device.startswith("cuda"))  # (b, L, D), copied back without waiting


def extract_features(
    cache: FeatureCache,
    files: ImageFiles,
    encoder: torch.nn.Module,
    *,
    transform=None,
    batch_size: int = 32,
    workers: int = 2,
    device: str = "cpu",
    skip_bad: bool = False,
    progress: bool = True,
    stop=None,
) -> list[str]:
    """Fill the cache's rows of `files` (a rank's share of `cache.todo`) with encoder features; return the messages
    of the images that could not be read or whose features came out NaN.

    On a GPU a batch's features are written while the GPU encodes the next one. `transform` maps
    (images (b, 3, S, S), cache rows (b,)) to the images to encode instead (the views). Without `skip_bad`
    the first unreadable image raises `CaptionerError` (the batch's good rows are saved).
    """
    if len(files) == 0:
        return []
    encoder = encoder.to(device)
    cuda = device.startswith("cuda")
    loader = DataLoader(
        files,
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=False,
        worker_init_fn=_leave_signals_to_the_main_process,
    )
    bad: list[str] = []
    bar = tqdm(total=len(files), desc="features", unit="img", disable=not progress, dynamic_ncols=True)
    pending = None  # the previous batch, its features on their way to the host
    with torch.inference_mode():
        for batch_rows, images, errors in loader:
            errors = list(errors)
            ok = [i for i, e in enumerate(errors) if not e]
            feats = _encode(encoder, images, batch_rows, ok, len(errors), device, transform) if ok else None
            if pending is not None:
                bad += _store(cache, files.paths, *pending, skip_bad)
                bar.update(len(pending[0]))
            pending = (batch_rows, errors, ok, feats)
            if stop is not None and stop.requested:
                break
        if pending is not None:
            bad += _store(cache, files.paths, *pending, skip_bad)
            bar.update(len(pending[0]))
    bar.close()
    return bad


def _to_host(feats: torch.Tensor, cuda: bool):
    """Features on their way to page-locked host memory (CUDA), with the event that says they are there."""
    if not cuda:
        return feats, None
    host = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
    host.copy_(feats, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(feats.device))  # the stream the copy is queued on, not the current device's
    return host, done


def _store(cache: FeatureCache, paths, batch_rows, errors: list[str], ok: list[int], feats, skip_bad: bool):
    """Write a batch's features (waiting for them first); its unreadable images' messages."""
    if ok:
        host, done = feats
        if done is not None:
            done.synchronize()
        feats = host.numpy()  # (b, L, D)
        # NaN is never stored (inf is clipped to the fp16 range by write): a broken encoder.
        nan = np.isnan(feats).reshape(len(ok), -1).any(axis=1)  # (b,)
        for i in np.flatnonzero(nan):
            errors[ok[i]] = (
                f"{paths[int(batch_rows[ok[i]])]}: the encoder's features for this image are NaN (broken encoder "
                "weights?)"
            )
        keep = [i for i, is_nan in zip(ok, nan) if not is_nan]
        if keep:
            cache.write(batch_rows[keep].numpy(), feats[~nan])
    failed = [(int(r), e) for r, e in zip(batch_rows, errors) if e]
    if failed and not skip_bad:
        raise CaptionerError(f"{failed[0][1]} (--skip-bad goes on without unreadable images)")
    cache.mark_bad([r for r, _ in failed])
    return [e for _, e in failed]
