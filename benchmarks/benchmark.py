"""Speed of the parts that matter, each printed beside its floor, on a CPU or a GPU.

    python benchmarks/benchmark.py [--device cpu|cuda] [--only encoder,decoder,prepare,caption,scst,objective]
        [--steps 10] [--decoder-variants fp32,bf16,compile] [--tutorial-models PATH/models.py]
        [--compile-encoder]

- encoder: one 224×224 image through the VGG16 trunk: eager torchvision fp32 (the floor the
  captioning goal is set against), channels-last, TorchScript freeze, torch.fx, ours
  (`optimize_encoder`), torch.compile with freezing (--compile-encoder); beside the FLOP floor
  (the trunk's FLOPs at the measured matmul rate).
- decoder: one training step as `fit` runs it (`train_step`: loss, backward, clipping, fused
  Adam) at batch 32, sizes 512, vocabulary 10,000, captions of 10–23 tokens; in fp32, bf16
  autocast and with the compiled step (default: all three on a GPU, fp32 on a CPU); beside
  sgrvinod's tutorial decoder restated in `sgrvinod_decoder.py`, and the tutorial's own
  models.py run as its train.py runs it when given its path; beside the FLOP floor.
- prepare: feature extraction, images/s, and captioning many files (`captioner caption`'s
  path), captions/s, on COCO-sized JPEGs; beside the bare VGG16 forward.
- caption: one image through `Captioner.caption` at beam 3, beside the bare VGG16 forward.
- scst: one self-critical step (sampling, CIDEr-D reward, backward, Adam) and the reward's share.
- objective: a training step on the default objective against the paper's, soft and hard.
- onnx: one caption and `caption_batch` on onnxruntime (`captioner export --onnx`) against PyTorch (CPU).
Then an estimate of COCO's times from the figures measured: `prepare`, one epoch of `fit`, and
captioning the 5,000 test images. Timings alternate between the things compared, so that
machine noise hits them alike, and report medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgrvinod_decoder import TutorialDecoder, load_tutorial_models, tutorial_loss, tutorial_train_step  # noqa: E402

from captioner.compiled import GRAPHS  # noqa: E402
from captioner.data.batches import Batch, FixedShapes, Views  # noqa: E402
from captioner.models.decoder import AttentionDecoder, DecoderConfig  # noqa: E402
from captioner.models.encoder import EncoderSpec, build_encoder  # noqa: E402
from captioner.models.fast_encoder import optimize_encoder  # noqa: E402
from captioner.models.views import max_shift, shifts  # noqa: E402
from captioner.objectives.objective import Objective  # noqa: E402
from captioner.objectives.terms import TermState  # noqa: E402
from captioner.train.checkpoints import Live  # noqa: E402
from captioner.train.config import TrainConfig  # noqa: E402
from captioner.train.distributed import Dist, Process  # noqa: E402
from captioner.train.resume import Start, settle  # noqa: E402
from captioner.train.setup import step_compiling, teacher_forced_objective  # noqa: E402
from captioner.train.step import (  # noqa: E402
    TrainStep,
    WeightAverage,  # noqa: E402
    make_optimizer,
)

B, L, D, V = 32, 196, 512, 10_000
WARMUP = 3  # untimed steps before timing: the compiled steps compile and record their graphs in them
# COCO with Karpathy's splits: 113,287 training images with 5 captions each; 5,000 test images.
COCO_IMAGES, COCO_TRAIN_CAPTIONS, COCO_TEST_IMAGES = 123_287, 113_287 * 5, 5_000


# helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict, repeats: int, device: torch.device, warmup: int = 1) -> dict[str, list[float]]:
    """Time each function `repeats` times, taking turns, after `warmup` untimed calls each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def med(ts: list[float]) -> float:
    return statistics.median(ts)


def fmt(ts: list[float]) -> str:
    return f"median {med(ts) * 1e3:8.1f} ms (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})"


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of float32 matmuls shaped like the models' (best of several shapes)."""
    rates = []
    for m, k, n in ((512, 512, 10_000), (6272, 512, 512), (3136, 1152, 256), (2048, 2048, 2048)):
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        reps = max(1, int((2e9 if device.type == "cpu" else 2e11) // (2 * m * k * n)))
        ts = interleaved({"mm": lambda: [a @ b for _ in range(reps)]}, 5, device)["mm"]
        rates.append(2 * m * k * n * reps / min(ts))
    return max(rates)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def flops_of(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


# sections


def bench_encoder(device: torch.device, repeats: int, rate: float, compile_too: bool) -> dict:
    plain, _ = build_encoder(EncoderSpec(weights="none"))
    plain = plain.to(device)
    x = torch.randn(1, 3, 224, 224, device=device)
    variants = {"eager torchvision fp32": plain}
    variants["channels-last"] = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    if device.type == "cpu":
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TorchScript is deprecated, still measured
            variants["TorchScript freeze + optimize_for_inference"] = torch.jit.optimize_for_inference(
                torch.jit.freeze(torch.jit.trace(copy.deepcopy(plain), x))
            )
        from torch.fx.experimental.optimization import optimize_for_inference as fx_optimize

        variants["torch.fx optimize_for_inference"] = fx_optimize(copy.deepcopy(plain))
    variants["ours: optimize_encoder"] = optimize_encoder(plain, device)
    if compile_too:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: packed convolutions
        compiled = torch.compile(copy.deepcopy(plain).to(memory_format=torch.channels_last))
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(x)
        print(f"  (torch.compile with freezing: {time.perf_counter() - t0:.0f} s to compile)")
        variants["torch.compile, freezing"] = compiled
    fns = {}
    for name, module in variants.items():
        xin = x.contiguous(memory_format=torch.channels_last) if name == "channels-last" else x
        fns[name] = (lambda m, xi: lambda: m(xi))(module, xin)
    with torch.inference_mode():
        ref = plain(x)
        errors = {name: float((fn() - ref).abs().max() / ref.abs().max()) for name, fn in fns.items()}
        flops = flops_of(lambda: plain(x))
        t = interleaved(fns, repeats, device)
    floor = flops / rate
    base = med(t["eager torchvision fp32"])
    print(f"encoder: VGG16 trunk to conv5_3, one 224x224 image, {flops / 1e9:.1f} GFLOP")
    for name, ts in t.items():
        print(
            f"  {name:44s} {fmt(ts)}  {med(ts) / base:5.2f}x eager  {med(ts) / floor:5.2f}x floor  "
            f"(max rel. difference {errors[name]:.1e})"
        )
    print(
        f"  floor: {flops / 1e9:.1f} GFLOP at the measured matmul rate {rate / 1e9:.0f} GFLOP/s = {floor * 1e3:.1f} ms"
    )
    return {"eager": base, "ours": med(t["ours: optimize_encoder"])}


def caption_batch(device: torch.device, seed: int = 0, batch_size: int = B):
    """COCO-like captions of 10-23 tokens (<start> and <end> included) over random features."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 24, (batch_size,), generator=g)
    T = int(lengths.max())
    caps = torch.randint(4, V, (batch_size, T), generator=g)
    caps[:, 0] = 1
    for b, n in enumerate(lengths):
        caps[b, n - 1] = 2
        caps[b, n:] = 0
    return torch.rand(batch_size, L, D, generator=g).to(device), caps.to(device), lengths.to(device)


def fit_batch(device: torch.device, batch_size: int, shapes: str, views: bool, seed: int = 0) -> Batch:
    """A batch as `fit`'s loader makes it for these shapes: fixed ones padded to the length bucket
    (FixedShapes over captions of up to 24 tokens); with the views of a quarter of the captions."""
    feats, caps, lengths = (t.cpu() for t in caption_batch(torch.device("cpu"), seed, batch_size))
    if shapes == "fixed":
        caps = torch.nn.functional.pad(
            caps, (0, FixedShapes.for_data(batch_size, 24).length(caps.size(1)) - caps.size(1))
        )
    batch = Batch(feats, caps, lengths)
    if views:
        k = math.ceil(0.25 * batch_size)
        g = torch.Generator().manual_seed(seed + 1)
        rows = torch.randperm(batch_size, generator=g)[:k].sort().values
        moves = torch.from_numpy(shifts(rows.numpy(), max_shift(14)))
        batch.views = Views(torch.rand(k, L, D, generator=g), rows, moves)
    return batch.to(device)


def fit_step(
    device: torch.device,
    batch_size: int = B,
    *,
    amp: str = "none",
    objective: str = "paper",
    attention: str = "soft",
    shapes: str = "auto",
    compiled: str | None = "auto",
):
    """`fit`'s own step (`train.step.TrainStep`), settled as `fit` settles it on `device`, on one batch.

    objective: "paper" (eq. 14 with λ = 1: what the tutorial trains) or "default" (`fit`'s defaults:
    λ = 0.3 and the view consistency, with the weights' average).
    compiled: the compiler's mode of the step ("auto": `fit`'s choice on `device`; None: eager).

    Returns:
        (one step as a callable, the decoder, the TrainStep)
    """
    torch.manual_seed(0)
    cfg = TrainConfig.of(
        amp=amp,
        batch_size=batch_size,
        shapes=shapes,
        paper=objective == "paper",
        ema=0.999 if objective == "default" else 0.0,
    )
    model_cfg = DecoderConfig(V, encoder_dim=D, dropout=0.5, attention=attention)
    model_cfg, cfg = settle(model_cfg, cfg, Start(V), device)
    decoder = AttentionDecoder(model_cfg).to(device)
    if compiled == "auto":
        compiled = step_compiling(cfg.process, device)
    views = objective == "default"
    objective = teacher_forced_objective(decoder, cfg, views=views, state=TermState(device))
    optimizer = make_optimizer([{"params": list(decoder.parameters())}], cfg.optim.lr)
    average = WeightAverage(decoder, cfg.optim.ema) if cfg.optim.ema else None
    live = Live(decoder, average, None, optimizer, None, torch.Generator(device=device).manual_seed(1), None)
    step = TrainStep(objective, live, cfg.optim, Process(Dist(), device, compiled))
    batch = fit_batch(device, batch_size, cfg.process.shapes, views)
    return (lambda: step(batch)), decoder, step


def bench_objective(device: torch.device, steps: int) -> None:
    """A training step on the default objective (the view consistency on a quarter of the
    captions, the weights' average) against the paper's (eq. 14, λ = 1), soft and hard, as `fit` runs them."""
    fns = {}
    for attention in ("soft", "hard"):
        for name in ("default", "paper"):
            fns[f"{attention}, {name}"] = fit_step(device, objective=name, attention=attention)[0]
    t = interleaved(fns, steps, device, warmup=5)
    print(f"training step, default objective against the paper's (B={B}, sizes 512, V={V}, captions 10-23 tokens)")
    for name, ts in t.items():
        attention = name.split(",")[0]
        print(f"  {name:16s} {fmt(ts)}  {med(ts) / med(t[f'{attention}, paper']):5.2f}x the paper's")


def tutorial_steps(device: torch.device, batch_size: int, tutorial_models: str | None) -> dict:
    """The tutorial's decoder restated, and its own models.py as its train.py runs it (when given)."""
    feats, caps, lengths = caption_batch(device, batch_size=batch_size)
    torch.manual_seed(0)
    restated = TutorialDecoder(attention_dim=512, embed_dim=512, decoder_dim=512, vocab_size=V, encoder_dim=D)
    restated = restated.to(device)
    opt = torch.optim.Adam(restated.parameters(), 4e-4)

    def restated_step():
        opt.zero_grad()
        tutorial_loss(restated, feats, caps, lengths).backward()
        opt.step()

    fns = {"sgrvinod restated (sgrvinod_decoder.py)": restated_step}
    if tutorial_models:
        fns["sgrvinod's own models.py, as its train.py"] = tutorial_train_step(
            load_tutorial_models(tutorial_models), feats, caps, lengths, V, device
        )
    return fns


def bench_decoder(
    device: torch.device, steps: int, rate: float, variants: list[str], tutorial_models: str | None, sizes: list[int]
) -> dict:
    """`fit`'s training step at each batch size and precision, beside the tutorial's, and the FLOP floor."""
    out = {}
    for batch_size in sizes:
        fns = {}
        for v in variants:
            fns[f"captioner, {v}"] = variant_step(device, batch_size, v)
        if "default" in variants or device.type == "cuda":
            fns["captioner, default objective"] = fit_step(device, batch_size, objective="default")[0]
        fns |= tutorial_steps(device, batch_size, tutorial_models)
        t0 = time.perf_counter()
        t = interleaved(fns, steps, device, warmup=WARMUP + 2)  # fit's steps are compiled by then
        print(f"  (warm-up and compiling: {time.perf_counter() - t0 - sum(map(sum, t.values())):.0f} s)")
        flops = flops_of(fit_step(device, batch_size, compiled=None)[0])
        ours = med(t[f"captioner, {variants[0]}"])
        floor = flops / rate
        print(
            f"decoder training step (B={batch_size}, sizes 512, V={V}, captions 10-23 tokens): forward, backward, "
            "update, each as its training code runs it"
        )
        for name, ts in t.items():
            tutorial = [n for n in t if n.startswith("sgrvinod")][-1]
            rel = (
                f"{med(t[tutorial]) / med(ts):5.2f}x faster than the tutorial's" if name.startswith("captioner") else ""
            )
            print(f"  {name:44s} {fmt(ts)}  {med(ts) / floor:5.2f}x floor  {rel}")
        print(
            f"  floor: {flops / 1e9:.1f} GFLOP at the measured matmul rate {rate / 1e9:.0f} GFLOP/s = "
            f"{floor * 1e3:.1f} ms"
        )
        out[batch_size] = {name: med(ts) for name, ts in t.items()} | {"ours": ours}
    return out


def variant_step(device: torch.device, batch_size: int, variant: str):
    """`fit`'s step in one variant: a precision (fp32, tf32, bf16), optionally `+eager` (`fit --cuda-graphs
    off`), `+compile` (compiled in the default mode: `--cuda-graphs off --compile`) or `+reduce-overhead`
    (`fit`'s own choice on a GPU). Without a `+`, the step `fit` runs on the device. "compile" alone is
    fp32+compile."""
    precision, _, how = ("fp32+compile" if variant == "compile" else variant).partition("+")
    amp = {"fp32": "none", "tf32": "tf32", "bf16": "bf16"}[precision]
    compiled = {"": "auto", "eager": None, "compile": "default", "reduce-overhead": GRAPHS}[how]
    shapes = "auto" if compiled in ("auto", None) else "fixed"  # auto: the shapes `fit` takes on the device
    fn = fit_step(device, batch_size, amp=amp, shapes=shapes, compiled=compiled)[0]
    return with_tf32(fn) if precision == "tf32" else fn


def with_tf32(fn):
    """fn with TF32 matmuls and convolutions (what `fit --amp tf32` sets), both as they were after it."""

    def run():
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            fn()
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before

    return run


def bench_kernels(device: torch.device, batch_size: int = B) -> None:
    """Kernels per training step and the share of the step the GPU is busy (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn, _, step = fit_step(device, batch_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved(device)
    for _ in range(WARMUP + 3):
        fn()
    torch.cuda.synchronize(device)
    graph_memory = torch.cuda.memory_reserved(device) - reserved  # warm-up and compile: mostly the graphs' pool
    n = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) / n
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1e6 / n  # kernel time per step, seconds
    launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel")]
    print(
        f"one training step, B={batch_size}: {len(kernels) / n:.0f} GPU kernels, {len(launches) / n:.0f} launches from "
        f"the host ({'compiled' if step.passes else 'eager'}); the GPU busy {busy * 1e3:.1f} ms of "
        f"{wall * 1e3:.1f} ms ({busy / wall:.0%}); the memory reserved grew "
        f"{graph_memory / 2**20:.0f} MiB over warm-up and compiling"
    )


def bench_search_profile(device: torch.device, beam_size: int = 3, n: int = 5) -> None:
    """Where one image's beam search spends its time: GPU kernels per step and their time, host launches,
    and the host's busiest operations (torch.profiler), on the bundled model's features of one photo."""
    from torch.profiler import ProfilerActivity, profile

    from captioner import Captioner
    from captioner.decoding.decode import beam_search
    from captioner.serve.sources import demo_model

    cap = Captioner.load(demo_model(), device=str(device))
    img = photo(np.random.RandomState(1))
    with torch.inference_mode():
        feats, _ = cap.encode([img])
        search = lambda: beam_search(cap.decoder, feats, beam_size=beam_size, max_len=cap.max_len)  # noqa: E731
        for _ in range(3):
            words = len(search()[0][0].tokens)
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                search()
            sync(device)
            wall = (time.perf_counter() - t0) / n
    events = prof.events()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1e6 / n
    graphs = sum(e.name == "cudaGraphLaunch" for e in events) / n
    launches = sum(e.name in ("cudaLaunchKernel", "cuLaunchKernel") for e in events) / n
    print(
        f"one image's beam search, beam {beam_size}, max {cap.max_len} words ({words} written): {wall * 1e3:.2f} ms; "
        f"{len(kernels) / n:.0f} GPU kernels taking {busy * 1e3:.2f} ms ({busy / wall:.0%} of it); {graphs:.0f} graph "
        f"replays and {launches:.0f} other kernel launches from the host"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


def photo(rs: np.random.RandomState):
    """A 640×480 stand-in for a photo: random colours at 80×60, smoothly enlarged (bicubic)."""
    from PIL import Image

    return Image.fromarray((rs.rand(480 // 8, 640 // 8, 3) * 255).astype(np.uint8)).resize((640, 480), Image.BICUBIC)


def _photo_set(root: str, n: int) -> tuple[str, str]:
    """n COCO-sized photos (640x480 JPEG with texture) and their captions file."""

    images = os.path.join(root, "images")
    os.makedirs(images)
    rs = np.random.RandomState(0)
    entries, anns = [], []
    for i in range(n):
        photo(rs).save(os.path.join(images, f"{i}.jpg"), quality=90)
        entries.append({"id": i + 1, "file_name": f"{i}.jpg"})
        anns.append({"id": i + 1, "image_id": i + 1, "caption": "a picture of noise"})
    caps = os.path.join(root, "captions.json")
    with open(caps, "w") as f:
        json.dump({"images": entries, "annotations": anns}, f)
    return caps, images


def vgg_rates(device: torch.device, batches=(1, 4, 8, 32)) -> dict[int, float]:
    """Images/s of the bare eager VGG16 trunk per batch size."""
    enc = build_encoder(EncoderSpec(weights="none"))[0].to(device)
    out = {}
    with torch.inference_mode():
        for b in batches:
            x = torch.randn(b, 3, 224, 224, device=device)
            out[b] = b / med(interleaved({"vgg": lambda: enc(x)}, max(3, 32 // b), device)["vgg"])
    return out


def bench_prepare(device: torch.device, small: int, large: int) -> dict:
    """Whole `prepare` runs on two set sizes: the difference is the steady rate, without the
    fixed start-up (building the encoder, starting workers, writing the vocabulary). Then the
    large set captioned through `captioner caption`'s path."""
    from captioner import Captioner
    from captioner.serve.bulk import caption_files, image_ids
    from captioner.serve.sources import demo_model
    from captioner.train.prepare import PrepareConfig, prepare

    rates = vgg_rates(device)
    best = max(rates, key=rates.get)
    took = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (16, small, large):  # the first run warms up CUDA and cuDNN's choice of kernels
            caps, images = _photo_set(os.path.join(tmp, str(n)), n)
            t0 = time.perf_counter()
            prepare(
                PrepareConfig(
                    captions=[caps],
                    images=[images],
                    out=os.path.join(tmp, f"data{n}"),
                    encoder=EncoderSpec(weights="none"),
                    min_count=1,
                    device=str(device),
                ),
                progress=False,
            )
            took[n] = time.perf_counter() - t0
        cap = Captioner.load(demo_model(), device=str(device))
        paths = sorted(os.path.join(images, f) for f in os.listdir(images))
        batch = 8 if device.type == "cpu" else 64
        caption_files(cap, paths[:batch], image_ids(paths[:batch]), batch_size=batch)  # warm-up
        t0 = time.perf_counter()
        caption_files(cap, paths, image_ids(paths), batch_size=batch, workers=2)
        captions_per_s = len(paths) / (time.perf_counter() - t0)
    steady = (large - small) / (took[large] - took[small])
    print(
        f"prepare (JPEGs of 640x480, default batch, 2 workers): {large} images in {took[large]:.1f} s; "
        f"steady rate {steady:.2f} images/s (from {small} vs {large} images)"
    )
    print("  bare eager VGG16 forward: " + ", ".join(f"batch {b}: {r:.2f}" for b, r in rates.items()) + " images/s")
    print(
        f"  floor: the fastest bare forward, batch {best}: {rates[best]:.2f} images/s; prepare's steady rate is "
        f"{steady / rates[best]:.2f}x of it"
    )
    print(
        f"captioning files (`captioner caption` path: decode threads, batch {batch}, beam 3), bundled model: "
        f"{captions_per_s:.2f} captions/s over {large} images, {captions_per_s / rates[best]:.2f}x the bare "
        "forward's images/s"
    )
    return {"prepare": steady, "captions": captions_per_s}


def bench_caption(device: torch.device, repeats: int) -> dict:

    from captioner import Captioner
    from captioner.decoding.decode import beam_search
    from captioner.serve.sources import demo_model

    cap = Captioner.load(demo_model(), device=str(device))
    # The floor the goal is set against: torchvision's own VGG16 conv stack up to conv5_3 + ReLU,
    # eager, fp32, contiguous input (random weights: the speed does not depend on them).
    plain = torchvision.models.vgg16(weights=None).features[:30].eval().requires_grad_(False).to(device)
    img = photo(np.random.RandomState(1))
    x = cap.encoder_spec.preprocess(img).unsqueeze(0).to(device)
    with torch.inference_mode():
        feats = cap.encoder(x)
        t = interleaved(
            {
                "Captioner.caption": lambda: cap.caption(img, beam_size=3),
                "bare torchvision VGG16 conv stack, eager fp32": lambda: plain(x),
                "  of which the encoder (ours)": lambda: cap.encoder(x),
                "  of which beam search": lambda: beam_search(cap.decoder, feats, beam_size=3, max_len=cap.max_len),
                "  of which preprocessing (the API's)": lambda: cap._inputs([img]),
            },
            repeats,
            device,
            warmup=2,
        )
    base = med(t["bare torchvision VGG16 conv stack, eager fp32"])
    print(f"one 640x480 image (224x224 into the encoder), beam 3, bundled model ({len(cap.caption(img).words)} words):")
    for name, ts in t.items():
        print(f"  {name:46s} {fmt(ts)}  {med(ts) / base:5.2f}x the bare forward")
    return {"caption": med(t["Captioner.caption"]), "vgg": base}


def bench_caption_batch(device: torch.device, repeats: int, batch: int = 64) -> dict:
    """`Captioner.caption_batch` at beam 3 on `batch` photos (PIL images: preprocessing included),
    images/s beside the encoder alone on the same batch, already preprocessed and on the device;
    then its parts, each alone: the API's preprocessing and the beam search."""

    from captioner import Captioner
    from captioner.decoding.decode import beam_search
    from captioner.serve.sources import demo_model

    cap = Captioner.load(demo_model(), device=str(device))
    rs = np.random.RandomState(2)
    images = [photo(rs) for _ in range(batch)]
    x = torch.stack([cap.encoder_spec.preprocess(im) for im in images]).to(device)
    with torch.inference_mode():
        feats = cap.encoder(x)  # (B, L, D)
        t = interleaved(
            {
                "caption_batch, beam 3": lambda: cap.caption_batch(images, beam_size=3, batch_size=batch),
                "the encoder alone": lambda: cap.encoder(x),
                "  of which preprocessing": lambda: cap._inputs(images),
                "  of which beam search": lambda: beam_search(cap.decoder, feats, beam_size=3, max_len=cap.max_len),
            },
            repeats,
            device,
            warmup=2,
        )
    rates = {name: batch / med(ts) for name, ts in t.items()}
    print(f"captioning {batch} photos of 640x480 in one batch, bundled model:")
    for name, r in rates.items():
        print(
            f"  {name:24s} {med(t[name]) * 1e3:7.1f} ms {r:8.1f} images/s  {r / rates['the encoder alone']:5.2f}x the "
            "encoder's"
        )
    return rates


def bench_onnx(repeats: int, batch: int = 16) -> None:
    """The bundled model on onnxruntime (`captioner export --onnx`) against PyTorch on the CPU, interleaved: one
    caption at beam 3, and `caption_batch` of `batch` photos; then each runtime's encoder and search alone."""
    from captioner import Captioner
    from captioner.decoding.beams import search
    from captioner.decoding.decode import DecoderStep
    from captioner.serve.onnx_export import export_onnx
    from captioner.serve.onnx_runtime import OnnxStep
    from captioner.serve.sources import demo_model

    with tempfile.TemporaryDirectory() as tmp:
        export_onnx(demo_model(), tmp)
        onnx = Captioner.load(tmp)
    cap = Captioner.load(demo_model())
    rs = np.random.RandomState(3)
    images = [photo(rs) for _ in range(batch)]
    x = torch.stack([cap.preprocess(im) for im in images[:1]])
    array = x.numpy()
    with torch.inference_mode():
        feats = cap.encoder(x)
        t = interleaved(
            {
                "one caption, PyTorch": lambda: cap.caption(images[0], beam_size=3),
                "one caption, onnxruntime": lambda: onnx.caption(images[0], beam_size=3),
                "  encoder, PyTorch (optimize_encoder)": lambda: cap.encoder(x),
                "  encoder, onnxruntime": lambda: onnx.sessions["encoder.onnx"].run(None, {"images": array}),
                "  search, PyTorch": lambda: search(
                    DecoderStep(cap.decoder, feats, 3, mode="expected", generator=None, sharpness=None), cap.max_len
                ),
                "  search, onnxruntime": lambda: search(OnnxStep(onnx, feats.numpy(), 3, onnx.sharpness), onnx.max_len),
                f"caption_batch of {batch}, PyTorch": lambda: cap.caption_batch(images, beam_size=3, batch_size=batch),
                f"caption_batch of {batch}, onnxruntime": lambda: onnx.caption_batch(
                    images, beam_size=3, batch_size=batch
                ),
            },
            repeats,
            torch.device("cpu"),
            warmup=2,
        )
    threads = torch.get_num_threads()
    print(f"onnxruntime against PyTorch on the CPU, bundled model, beam 3, 640x480 photos ({threads} threads):")
    for name, ts in t.items():
        print(f"  {name:42s} {fmt(ts)}")
    for what in ("one caption", f"caption_batch of {batch}"):
        print(f"  {what}: onnxruntime {med(t[f'{what}, PyTorch']) / med(t[f'{what}, onnxruntime']):.2f}x as fast")


def estimate_coco(decoder: dict | None, prepare: dict | None) -> None:
    """COCO's times from the figures measured: prepare, an epoch of fit at each batch size, the test split."""
    print(
        "estimated COCO times on this machine (Karpathy splits; the benchmark's captions are 10-23 "
        "tokens, COCO's average about 13, so the epoch is an upper estimate):"
    )
    if prepare:
        print(
            f"  prepare, {COCO_IMAGES:,} images at {prepare['prepare']:.2f} images/s: "
            f"{COCO_IMAGES / prepare['prepare'] / 3600:.1f} h"
        )
    for batch_size, timings in (decoder or {}).items():
        steps = math.ceil(COCO_TRAIN_CAPTIONS / batch_size)
        for name, s in timings.items():
            if name.startswith("captioner"):
                print(
                    f"  one epoch of fit ({name.split(', ')[1]}), {steps:,} steps of {batch_size} at {s * 1e3:.0f} "
                    f"ms: {steps * s / 3600:.1f} h"
                )
    if prepare:
        print(
            f"  captioning the {COCO_TEST_IMAGES:,} test images at {prepare['captions']:.2f} captions/s: "
            f"{COCO_TEST_IMAGES / prepare['captions'] / 60:.0f} min"
        )


def bench_scst(steps: int, images: int = 32, samples: int = 5) -> None:
    """One `fit --objective scst` step at the default batch (32 images x 5 samples), sizes 512,
    V=10,000, 5 references of 10-23 tokens per image. An untrained model samples until max_len
    (20 words): the longest captions, so the most work for sampling and for the reward alike."""
    from captioner.data.batches import ImageBatch
    from captioner.objectives.cider import DocumentFrequency, NgramScorer, References
    from captioner.objectives.scst import ScstConfig, SelfCritical

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 24, (images * 5,), generator=g)  # 5 references per image
    refs = References(
        torch.randint(4, V, (images * 5, 24), generator=g), lengths, torch.arange(images).repeat_interleave(5), base=V
    )
    scorer = NgramScorer(refs, DocumentFrequency.from_references(refs))
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=V, encoder_dim=D, embed_dim=512, hidden_dim=512, attention_dim=512, dropout=0.2)
    term = SelfCritical(ScstConfig(samples=samples), scorer, max_len=20)
    objective = Objective(dec, [term])
    opt = make_optimizer([{"params": list(dec.parameters())}], 5e-5)
    batch = ImageBatch(torch.rand(images, L, D, generator=g), torch.arange(images))
    spent: list[float] = []
    reward = term.reward

    def timed_reward(*args):
        t0 = time.perf_counter()
        out = reward(*args)
        spent.append(time.perf_counter() - t0)
        return out

    term.reward = timed_reward

    def step():
        loss, _ = objective(batch, float(images), generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()

    t_step = interleaved({"scst": step}, steps, torch.device("cpu"))["scst"]
    t_reward = spent[-steps:]
    share = sum(t_reward) / sum(t_step)
    print(
        f"self-critical step ({images} images x {samples} samples = {images * samples} captions of "
        f"{term.max_len} words + <end>, sizes 512, V={V}): sampling with gradients, CIDEr-D, backward, Adam"
    )
    print(f"  whole step {fmt(t_step)}")
    print(f"  reward     {fmt(t_reward)}  ({share:.1%} of the step)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated sections of encoder, decoder, kernels, prepare, caption, search, batch, scst, "
        "objective, onnx (default: all; kernels and search on a GPU only, onnx on a CPU only)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per measurement")
    p.add_argument(
        "--decoder-variants",
        default=None,
        help="of fp32, tf32, bf16, each optionally +compile or +reduce-overhead (PyTorch's CUDA graphs in place of "
        "the project's); compile alone is fp32+compile (default: fp32, tf32, bf16 and compile on a GPU, fp32 on a CPU)",
    )
    p.add_argument(
        "--batch-sizes", default=None, help="training steps' batch sizes (default: 32 on a CPU; 32,128,512 on a GPU)"
    )
    p.add_argument(
        "--tutorial-models",
        metavar="PATH",
        help="the tutorial's models.py (git clone "
        "https://github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning), timed as its train.py runs it",
    )
    p.add_argument(
        "--compile-encoder",
        action="store_true",
        help="also time torch.compile of the encoder (compiling takes 15-45 s on 2 cores)",
    )
    p.add_argument(
        "--prepare-images",
        type=int,
        default=None,
        help="images in prepare's larger set (default 160 on a CPU, 2,000 on a GPU)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is available here")
    if args.tutorial_models and not os.path.isfile(args.tutorial_models):
        p.error(f"--tutorial-models {args.tutorial_models}: no such file (the tutorial's models.py)")
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores{gpu}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    cuda = device.type == "cuda"
    every = (
        "encoder,decoder,kernels,prepare,caption,search,batch,scst,objective"
        if cuda
        else "encoder,decoder,prepare,caption,scst,objective,onnx"
    )
    sections = (args.only or every).split(",")
    variants = (args.decoder_variants or ("fp32,tf32,bf16,compile" if cuda else "fp32")).split(",")
    sizes = [int(b) for b in (args.batch_sizes or ("32,128,512" if cuda else "32")).split(",")]
    rate = matmul_rate(device)
    decoder = prepare = None
    if "encoder" in sections:
        bench_encoder(device, args.steps, rate, args.compile_encoder)
    if "decoder" in sections:
        decoder = bench_decoder(device, args.steps, rate, variants, args.tutorial_models, sizes)
    if "kernels" in sections and cuda:
        bench_kernels(device)
    if "prepare" in sections:
        large = args.prepare_images or (160 if device.type == "cpu" else 2000)
        prepare = bench_prepare(device, small=large // 5, large=large)
    if "caption" in sections:
        bench_caption(device, args.steps)
    if "search" in sections and cuda:
        bench_search_profile(device)
    if "batch" in sections:
        bench_caption_batch(device, args.steps)
    if "scst" in sections:
        bench_scst(args.steps)
    if "objective" in sections:
        bench_objective(device, args.steps)
    if "onnx" in sections and not cuda:
        bench_onnx(args.steps)
    if decoder or prepare:
        estimate_coco(decoder, prepare)


if __name__ == "__main__":
    main()
