"""One optimisation step, the same on every device; on a GPU with fixed shapes, replayed as a CUDA graph.

`TrainStep` takes a batch to an applied (or skipped) update: the objective's loss and terms,
backward, clipping, Adam, the weights' moving average and the terms' own state (hard
attention's baseline), with nothing read back to the host. A step whose loss, a term or the
gradient norm is not finite is skipped on the device (fused Adam's `found_inf`: the weights,
the moments and the step count stay as they were). The terms are summed on the device and
read back when the loop asks (`read`, at each log line). Under DDP the batch's word count is
summed over processes on the device, and so is the skip flag, so that all processes agree.

With fixed shapes on CUDA (`objectives.passes`), when every term is capturable and the run is
one process, each length bucket's step is captured once as a CUDA graph after a few eager
steps (PyTorch's "whole-network capture": forward, backward, clipping, Adam, the average) and
then replayed: one launch per step, the batch first copied into the graph's static inputs. The
random draws (dropout, hard attention's locations, the consistency's picks) come from
generators registered with the graph, so each replay draws anew.

Shapes: B captions (images for SCST), T tokens.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import fields

import torch
import torch.distributed as torch_dist

from captioner.train import distributed
from captioner.train.averaging import WeightAverage
from captioner.train.config import OptimConfig

AMP_DTYPES = {"none": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
WARMUP = 3  # eager steps of a length bucket before its graph is captured

log = logging.getLogger(__name__)


def make_optimizer(groups: list[dict], lr: float, device: torch.device) -> torch.optim.Adam:
    """Adam, fused into one kernel per step (CPU and CUDA). On CUDA its learning rates are tensors and
    its state capturable, so that a CUDA graph can replay its step and the schedule can still change the
    rate (in place)."""
    cuda = device.type == "cuda"
    if cuda:
        groups = [{**g, "lr": torch.tensor(g.get("lr", lr), device=device)} for g in groups]
    rate = torch.tensor(lr, device=device) if cuda else lr
    return torch.optim.Adam(groups, lr=rate, fused=True, capturable=cuda)


def set_lr(group: dict, value: float) -> None:
    """A parameter group's learning rate, set in place where it is a tensor (a graph reads it there)."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


class TrainStep:
    """Steps an objective's loss with an optimizer; see the module doc.

    Args:
        objective: `objectives.objective.Objective` (DDP-wrapped under torchrun).
        optimizer: from `make_optimizer`.
        cfg: clipping, precision.
        average: the weights' moving average (`--ema`), or None.
        generator: the terms' random draws (one stream per process).
        d, device: this process's place and device.
        steps: optimizer steps taken so far (a resumed run's), for the average's ramp.
        graphs: capture CUDA graphs where the module doc says they can be.
    """

    def __init__(
        self,
        objective,
        optimizer: torch.optim.Optimizer,
        cfg: OptimConfig,
        *,
        average: WeightAverage | None,
        generator: torch.Generator,
        d: distributed.Dist,
        device: torch.device,
        steps: int = 0,
        graphs: bool = True,
    ):
        self.objective, self.optimizer, self.cfg, self.average = objective, optimizer, cfg, average
        self.generator, self.d, self.device = generator, d, device
        self.module = getattr(objective, "module", objective)  # the Objective itself, under DDP too
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == "fp16" and device.type == "cuda")
        self.steps = torch.tensor(float(steps), device=device)  # optimizer steps so far, for the average
        self.skip = torch.zeros((), device=device)  # 1.0: this step is not applied (Adam's found_inf)
        self.optimizer.found_inf = self.skip
        self.sums: dict[str, torch.Tensor] = {}  # each term's sum over the applied steps since `read`
        self.applied = torch.zeros((), device=device)
        self.skipped = torch.zeros((), device=device)
        self.graphs = {} if graphs and self._capturable() else None
        self.seen: dict[tuple, int] = {}

    def _capturable(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.d.active
            and self.module.capturable
            and not self.scaler.is_enabled()
            and hasattr(torch.cuda.CUDAGraph, "register_generator_state")
        )

    def __call__(self, batch) -> None:
        """One step on this process's share of a global batch (already on the device)."""
        self.objective.train()
        if self.graphs is None:
            self._iteration(batch, eager=True)
            return
        key = _shape_key(batch)
        graph = self.graphs.get(key)
        if graph is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] <= WARMUP:
                self._iteration(batch, eager=True)
                return
            graph = self.graphs[key] = self._capture(batch)
        graph.replay(batch)

    def _iteration(self, batch, eager: bool) -> None:
        """Forward, backward, clip, Adam, average, the terms' state, and the sums: all on the device."""
        count = batch.count
        if self.d.active:  # the global batch's words over processes: N processes give one big batch's gradient
            count = count.clone()
            torch_dist.all_reduce(count)
            count = count / self.d.world
        amp = AMP_DTYPES[self.cfg.amp]
        autocast = torch.autocast(self.device.type, dtype=amp) if amp else contextlib.nullcontext()
        with autocast:
            loss, values = self.objective(batch, count, self.generator)
        if eager:
            self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        values = {"loss": loss.detach(), **values, "grad_norm": norm}
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
            if getattr(term, "sums", None) and self.d.active:
                for t in term.sums:
                    torch_dist.all_reduce(t)
            term.after_step(applied)
        self._accumulate(values, applied)

    def _accumulate(self, values: dict[str, torch.Tensor], applied: torch.Tensor) -> None:
        for name, value in values.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros((), device=self.device)
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

    def _capture(self, batch) -> _Graph:
        """The iteration on `batch`'s shapes as a CUDA graph (its static inputs a copy of `batch`)."""
        static = batch.to(self.device)  # the graph's own input tensors
        static = type(batch)(**{f.name: _clone(getattr(static, f.name)) for f in fields(static)})
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.generator)
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the graph's own gradients
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.graph(graph, stream=stream):
            self._iteration(static, eager=False)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        log.info(f"captured the training step of batches of shape {tuple(batch.captions.shape)} as a CUDA graph")
        return _Graph(graph, static)


class _Graph:
    """A captured iteration and its static batch."""

    def __init__(self, graph, static):
        self.graph, self.static = graph, static

    def replay(self, batch) -> None:
        for f in fields(self.static):
            target = getattr(self.static, f.name)
            if torch.is_tensor(target):
                target.copy_(getattr(batch, f.name), non_blocking=True)
        self.graph.replay()


def _clone(value):
    return value.clone() if torch.is_tensor(value) else value


def _shape_key(batch) -> tuple:
    """What a graph is specialised to: the shapes of the batch's tensors (None where a field is absent)."""
    return tuple(
        tuple(v.shape) if torch.is_tensor(v) else None for v in (getattr(batch, f.name) for f in fields(batch))
    )
