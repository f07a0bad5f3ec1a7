"""Cost of one training step, frozen encoder against `--fine-tune-encoder` (conv5_1 and conv4_1).

Times the real step (`captioner.train.step.TrainStep`: forward, backward, clipping, Adam) on a prepared
data directory, with the default decoder, batch size 32 captions:

    python benchmarks/finetune_step.py --data /tmp/k_data [--steps 10] [--modes frozen conv5_1 conv4_1]

frozen reads the cached conv5_3 features; conv5_1 runs conv5_1..conv5_3 on the pool4 cache (made
first if the data directory lacks it, not timed); conv4_1 decodes the images in DataLoader
workers and runs the layers from conv4_1 on. Fine-tuning batches hold all captions of ~6 images.
Reports the median step (wall clock, and this process's CPU time: on a shared machine the CPU
time still says what a step costs; with --workers 0 image decoding is counted in it too) and the
median per caption, after one warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from captioner.data.batches import CaptionBatches
from captioner.data.dataset import CaptionData
from captioner.models.decoder import AttentionDecoder
from captioner.objectives.terms import TermState
from captioner.train import distributed
from captioner.train.checkpoints import Live
from captioner.train.config import TrainConfig
from captioner.train.finetune import FineTuneConfig, FineTuning
from captioner.train.resume import Start, settle
from captioner.train.setup import teacher_forced_objective
from captioner.train.step import TrainStep, make_optimizer


def time_steps(
    data: CaptionData, mode: str, steps: int, batch_size: int, workers: int
) -> tuple[list[float], list[float], list[int]]:
    """`fit`'s step (`train.step.TrainStep`), settled as `fit` settles it on the CPU, timed with its batches."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    fine_tune = None if mode == "frozen" else FineTuneConfig(mode, after=0)
    given = TrainConfig.of(batch_size=batch_size, workers=workers, fine_tune=fine_tune)
    model_cfg, cfg = settle(None, given, Start(len(data.vocab), views=data.views is not None), cpu)
    decoder = AttentionDecoder(model_cfg)
    decoder.set_feature_stats(*data.feature_stats())
    groups, encoder = [{"params": list(decoder.parameters())}], None
    views = cfg.terms.consistency > 0 and (fine_tune is not None or data.views is not None)
    share = cfg.terms.consistency_share if views else 0.0
    if fine_tune is None:
        source = CaptionBatches(data, batch_size, view_share=share)
    else:
        source = FineTuning(data, cfg, distributed.Process(distributed.Dist(), cpu))
        groups.append({"params": list(source.parameters()), "lr": cfg.fine_tune.lr})
        encoder = source.encoder
    objective = teacher_forced_objective(decoder, cfg, views=views, state=TermState(cpu), encoder=encoder)
    live = Live(decoder, None, None, make_optimizer(groups, cfg.optim.lr), None, torch.Generator().manual_seed(1), None)
    step = TrainStep(objective, live, cfg.optim, distributed.Process(distributed.Dist(), cpu))
    times, cpu_times, sizes = [], [], []
    batches = source.batches(seed=0, epoch=0)
    step(next(batches))  # warm-up
    t, c = time.perf_counter(), time.process_time()
    for _, batch in zip(range(steps), batches):  # batch loading is part of the step
        step(batch)
        now, now_c = time.perf_counter(), time.process_time()
        times.append(now - t)
        cpu_times.append(now_c - c)
        sizes.append(len(batch.captions))
        t, c = now, now_c
    return times, cpu_times, sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a prepared data directory")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="0: decode images in this process (counted in CPU time)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--modes", nargs="+", default=["frozen", "conv5_1", "conv4_1"], choices=["frozen", "conv5_1", "conv4_1"]
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = CaptionData(args.data)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch_size} captions")
    for mode in args.modes:
        times, cpu, sizes = time_steps(data, mode, args.steps, args.batch_size, args.workers)
        per_caption = statistics.median(t / n for t, n in zip(cpu, sizes))
        print(
            f"{mode:8s} step {1000 * statistics.median(times):7.0f} ms wall (median of {len(times)}; "
            f"{1000 * min(times):.0f}-{1000 * max(times):.0f}), {1000 * statistics.median(cpu):7.0f} ms CPU; "
            f"CPU per caption {1000 * per_caption:6.1f} ms; captions/step {statistics.median(sizes):.0f}"
        )


if __name__ == "__main__":
    main()
