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
steps on a side stream (PyTorch's "whole-network capture": forward, backward, clipping, Adam,
the average, the terms' state; `cuda_graphs`) and then replayed: one launch per step,
the batch first copied into the graph's static inputs. The random draws (dropout, hard
attention's locations, the consistency's picks) come from generators registered with the
graph, so each replay draws anew. A capture refused before CUDA began it, or a replay that fails,
is logged once with its error and shape; that batch, and every later one of its shape, then runs
eagerly, exactly as it would have without graphs. A capture that fails inside CUDA raises
`CaptureBroken`: the process cannot go on safely (`cuda_graphs`), and `fit` ends there.
The graphs read the learning rates from tensors they own: a schedule that sets a rate as a float
(ReduceLROnPlateau on some torch versions, a resumed optimizer's state) is copied into them before
the next step.

Shapes: B captions (images for SCST), T tokens.
"""

from __future__ import annotations

import logging
from dataclasses import fields

import torch
import torch.distributed as torch_dist

from captioner.cuda_graphs import FELL_BACK, CaptureBroken, GraphCapture, autocast, first_line
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
        graphs: what captures and replays the graphs (`cuda_graphs.GraphCapture`), or None for
            eager steps only; used where the module doc says a step can be captured.
        on_fallback: called with a message when a graph fails and its shape goes eager.
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
        graphs: GraphCapture | None = None,
        on_fallback=None,
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
        self.maker = graphs if graphs is not None and self._capturable(graphs) else None
        self.graphs: dict[tuple, _Graph] = {}
        self.eager: set[tuple] = set()  # shapes whose graph failed
        self.seen: dict[tuple, int] = {}
        self.on_fallback = on_fallback or log.warning
        # The rates a graph reads: tensors on the device, the same objects for the whole run.
        self.rates = [_rate(g["lr"], device) for g in optimizer.param_groups] if self.maker else []
        for group, rate in zip(optimizer.param_groups, self.rates):
            group["lr"] = rate

    def _capturable(self, graphs: GraphCapture) -> bool:
        return (
            graphs.supported(self.device)
            and not self.d.active
            and self.module.capturable
            and not self.scaler.is_enabled()
        )

    def __call__(self, batch) -> None:
        """One step on this process's share of a global batch (already on the device)."""
        self.objective.train()
        if self.maker is None:
            self._iteration(batch)
            return
        self._sync_rates()
        key = _shape_key(batch)
        graph = self.graphs.get(key)
        if graph is None and key not in self.eager:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] > WARMUP:
                graph = self._capture(batch, key)
        if graph is not None:
            try:
                graph.replay(batch)
                return
            except Exception as e:  # noqa: BLE001 - any failure of the graph leaves its shape to eager steps
                self._fall_back(key, "replay", e)
        if key in self.eager:
            self._iteration(batch)
        else:
            with self.maker.side():  # warm-up before a capture: on the side stream, as documented
                self._iteration(batch)

    def _sync_rates(self) -> None:
        """Put each group's current rate into the tensor the graphs read (a float where a schedule set one)."""
        for group, rate in zip(self.optimizer.param_groups, self.rates):
            lr = group["lr"]
            if lr is rate:
                continue
            if torch.is_tensor(lr):
                rate.copy_(lr)
            else:
                rate.fill_(lr)
            group["lr"] = rate

    def _iteration(self, batch) -> None:
        """Forward, backward, clip, Adam, average, the terms' state, and the sums: all on the device.
        Gradients start from None, so a captured backward writes them (and an eager one too)."""
        count = batch.count
        if self.d.active:  # the global batch's words over processes: N processes give one big batch's gradient
            count = count.clone()
            torch_dist.all_reduce(count)
            count = count / self.d.world
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, AMP_DTYPES[self.cfg.amp], graphed=self.maker is not None):
            loss, values = self.objective(batch, count, self.generator)
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
            if self.d.active:  # what the terms' state moves by, over all processes
                for t in term.shared():
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

    def _capture(self, batch, key: tuple) -> _Graph | None:
        """The iteration on `batch`'s shapes as a graph (its static inputs a copy of `batch`); None, and
        the shape left to eager steps, if the capture fails."""
        static = batch.to(self.device)  # the graph's own input tensors
        static = type(batch)(**{f.name: _clone(getattr(static, f.name)) for f in fields(static)})
        what = f"the training step for batches of shape {key[1]}"
        try:
            graph = self.maker.capture(lambda: self._iteration(static), generators=(self.generator,), what=what)
        except CaptureBroken:
            raise
        except Exception as e:  # noqa: BLE001 - refused before CUDA began the capture: the step goes on eagerly
            self._fall_back(key, "capture", e)
            return None
        log.info(f"captured the training step of batches of shape {tuple(batch.captions.shape)} as a CUDA graph")
        self.graphs[key] = _Graph(graph, static)
        return self.graphs[key]

    def _fall_back(self, key: tuple, what: str, error: Exception) -> None:
        self.graphs.pop(key, None)
        self.eager.add(key)
        self.on_fallback(
            f"{FELL_BACK}: the training step's {what} failed for batches of shape {key[1]} "
            f"({first_line(error)}); steps of that shape run eagerly from here"
        )


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


def _rate(lr, device: torch.device) -> torch.Tensor:
    return lr if torch.is_tensor(lr) and lr.device == device else torch.tensor(float(lr), device=device)


def _clone(value):
    return value.clone() if torch.is_tensor(value) else value


def _shape_key(batch) -> tuple:
    """What a graph is specialised to: the shapes of the batch's tensors (None where a field is absent)."""
    return tuple(
        tuple(v.shape) if torch.is_tensor(v) else None for v in (getattr(batch, f.name) for f in fields(batch))
    )
