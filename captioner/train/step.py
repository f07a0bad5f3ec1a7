"""One optimisation step, the same on every device; its forward and backward compiled by PyTorch where asked; the
weights' average (`--ema`) and the learning rate's cooldown at the end of the time budget (`--max-minutes`).

Nothing is read back to the host: a step whose loss, a term or the gradient norm is not finite is skipped on the
device (fused Adam's `found_inf`), and the terms are summed there until a log line reads them (`read`). Compiled,
the objective's forward compiles in place, whole, once per length bucket, so that under DDP the DDP module calls it
(PyTorch's documented way; there in the default mode, which splits the graph at DDP's buckets). It is compiled once a
process (`compiled_forward`): every fit's steps call the same compiled function, so later fits reuse what the first
compiled instead of spending the compiler's recompile budget anew. The compiled forward
draws from the device's default generator, not `generator`. The update runs eagerly: fused Adam is one kernel per
group, which the compiler does not trace.
Shapes: B captions (images for SCST), T tokens.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time

import torch
import torch.distributed as torch_dist
from torch import nn

from captioner.compiled import Compiled
from captioner.train import distributed
from captioner.train.config import OptimConfig, Progress, TrainConfig

AMP_DTYPES = {"none": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
RECOMPILES = 16  # most compiles of a step's forward: a few length buckets, in two stages


@functools.cache
def compiled_forward(forward, mode: str):
    """An objective class's `forward` (unbound) compiled in `mode`, once per process; a step passes its objective."""
    return torch.compile(forward, mode=mode, fullgraph=True, dynamic=False)


def make_optimizer(groups: list[dict], lr: float) -> torch.optim.Adam:
    """Adam, fused into one kernel per step (CPU and CUDA)."""
    return torch.optim.Adam(groups, lr=lr, fused=True)


class TrainStep:
    """Steps an objective's loss (DDP-wrapped under torchrun) with the run's optimizer, its weights' average and
    its terms' state; `steps`: optimizer steps so far (a resumed run's), for the average's ramp."""

    def __init__(self, objective, live, cfg: OptimConfig, process: distributed.Process, steps: int = 0):
        self.objective, self.optimizer, self.cfg, self.average = objective, live.optimizer, cfg, live.average
        self.generator, self.d, self.device = live.generator, process.dist, process.device
        device, d = self.device, self.d
        self.module = getattr(objective, "module", objective)  # the Objective itself, under DDP too
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
        self.steps = torch.tensor(float(steps), device=device)  # optimizer steps so far, for the average
        self.skip = torch.zeros((), device=device)  # 1.0: this step is not applied (Adam's found_inf)
        self.optimizer.found_inf = self.skip
        self.sums: dict[str, torch.Tensor] = {}  # each term's sum over the applied steps since `read`
        self.applied = torch.zeros((), device=device)
        self.skipped = torch.zeros((), device=device)
        self.passes = None
        if process.compiling is not None and self.module.capturable:
            mode, forward = "default" if d.active else process.compiling, type(self.module).forward
            eager = forward.__get__(self.module)
            compiled = self.module.forward = functools.partial(compiled_forward(forward, mode), self.module)

            def eager_pass(*args):
                self.module.forward = eager
                try:
                    return self._pass(*args)
                except BaseException:  # a bad input, the caller's error: the forward stays compiled
                    if self.passes.failed is None:
                        self.module.forward = compiled
                    raise

            what = "the training step's forward and backward"
            self.passes = Compiled(eager_pass, what, mode=mode, compiled=self._pass, limit=RECOMPILES)

    def __call__(self, batch) -> None:
        """One step on this process's share of a global batch (already on the device)."""
        self.objective.train()
        count = batch.count
        if self.d.active:  # the global batch's words over processes: N processes give one big batch's gradient
            count = count.clone()
            torch_dist.all_reduce(count)
            count = count / self.d.world
        self.optimizer.zero_grad(set_to_none=True)
        for term in self.module.terms:  # once, before the pass and outside a fallback's eager retry of it
            term.before_pass(self.module.decoder, batch)
        values = (self.passes or self._pass)(batch, count)
        for name in [*values, "grad_norm"]:
            if name not in self.sums:
                self.sums[name] = torch.zeros((), device=self.device)
        self._update(values)

    def _pass(self, batch, count: torch.Tensor) -> dict[str, torch.Tensor]:
        """Forward and backward (gradients start from None, so the backward writes them): loss and terms' values."""
        generator = None if self.passes is not None and self.passes.failed is None else self.generator
        dtype = AMP_DTYPES[self.cfg.amp]
        with torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            loss, values = self.objective(batch, count, generator)
        self.scaler.scale(loss).backward()
        return {"loss": loss.detach(), **values}

    def _update(self, values: dict[str, torch.Tensor]) -> None:
        """Clip, Adam, average, the terms' state, and the sums: all on the device."""
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        values = {**values, "grad_norm": norm}
        bad = (~torch.isfinite(torch.stack([v.float() for v in values.values()]))).any().float()
        if self.d.active:  # a NaN on any process skips the step on all
            torch_dist.all_reduce(bad, op=torch_dist.ReduceOp.MAX)
        self.skip.copy_(bad)
        self.optimizer.step()
        self.scaler.update()
        applied = self.skip == 0
        self.steps.add_(1)
        if self.average is not None:
            self.average.update(self.module.decoder, self.steps, applied)
        for term in self.module.terms:
            if self.d.active:  # what the terms' state moves by, over all processes
                for t in term.shared():
                    torch_dist.all_reduce(t)
            term.after_step(applied)
        for name, value in values.items():
            self.sums[name].add_(torch.where(applied, value.float(), 0.0))
        self.applied.add_(applied.float())
        self.skipped.add_(self.skip)

    def read(self) -> tuple[dict[str, float], int]:
        """The mean of each term over the applied steps since the last read (over processes under DDP),
        and how many steps were skipped; one read back to the host."""
        names = list(self.sums)
        stacked = torch.stack([self.sums[k] for k in names] + [self.applied, self.skipped])
        if self.d.active:
            torch_dist.all_reduce(stacked)
        values = stacked.tolist()
        for t in [*self.sums.values(), self.applied, self.skipped]:
            t.zero_()
        applied, skipped = values[-2], values[-1]
        if self.d.active:  # every process takes every step
            applied, skipped = applied / self.d.world, skipped / self.d.world
        means = {k: (v / self.d.world) / applied if applied else float("nan") for k, v in zip(names, values)}
        return means, int(round(skipped))


class WeightAverage:
    """A copy of `model` whose parameters follow their exponential moving average (Polyak and Juditsky, 1992):
    `fit --ema DECAY`, the most of itself the average keeps at a step; buffers are copied once (they do not train).

    At a constant learning rate the weights jitter around where the loss is low, and which validation happens to
    catch them low or high decides `best.pt`; the average sits nearer the middle. So validation captions with it and
    every checkpoint holds it as its model, while the optimizer steps the raw weights (saved beside it, for
    `--resume`). After step t it keeps min(DECAY, (1 + t) / (10 + t)) of itself: early on it spans about the last
    tenth of the steps, so the first random weights do not linger. Fine-tuned encoder layers are not averaged."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def update(self, model: nn.Module, step: torch.Tensor | int, applied: torch.Tensor | bool = True) -> None:
        """Move the average towards `model`'s weights after optimizer step `step` (counted from 1); not
        at all where `applied` is False (a skipped step). On the device, with no read back to the host."""
        step = torch.as_tensor(step, dtype=torch.float32, device=self.device)
        keep = ((1 + step) / (10 + step)).clamp(max=self.decay)
        weight = (1.0 - keep) * torch.as_tensor(applied, device=self.device)  # (), 0 when not applied
        for average, w in zip(self.model.parameters(), model.parameters()):
            average.lerp_(w.detach(), weight.to(average.dtype))

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


class Budget:
    """The run's time (`--max-minutes`, counted from the start of its log) and the cooldown at its end."""

    def __init__(self, cfg: TrainConfig, *, started: float):
        minutes = cfg.process.max_minutes
        self.seconds = minutes * 60 if minutes else math.inf
        self.cooldown, self.started = cfg.schedule.cooldown, started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out(self) -> bool:
        return self.elapsed() > self.seconds

    @property
    def cools(self) -> bool:
        return self.cooldown > 0 and math.isfinite(self.seconds)

    def rate_left(self, elapsed: float) -> float:
        """The share of its rate the learning rate keeps at `elapsed` seconds: 1 until the last `cooldown`
        share of the budget, then falling linearly to 0."""
        return min(1.0, max(0.0, (self.seconds - elapsed) / (self.cooldown * self.seconds)))

    def cool(self, optimizer: torch.optim.Optimizer, progress: Progress, d: distributed.Dist, device) -> None:
        """Over the last `cooldown` share of the time budget, the learning rate falls linearly to 0 from
        where it was (a warmup-stable-decay schedule without the warmup: Hägele et al., 2024, found a
        cooldown of about a fifth of training as good as cosine decay, without fixing the length of
        training in advance), so that a run still improving when its time runs out ends on weights
        that have settled. Under DDP the processes' clocks are averaged, every step."""
        if not self.cools:
            return
        left = self.rate_left(distributed.all_sum(d, [self.elapsed()], device)[0] / d.world)
        if left == 1.0:
            return
        if progress.cooldown_from is None:
            progress.cooldown_from = [float(g["lr"]) for g in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, progress.cooldown_from):
            group["lr"] = lr * left  # a float: the step puts it where its compiled code reads it
