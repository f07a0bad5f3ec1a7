"""Speed of the parts that matter, each printed beside its floor on this machine.

    python benchmarks/benchmark.py [--only decoder,prepare,caption] [--steps 10]

- decoder: one training step (forward, backward, Adam) at batch 32, all sizes 512, vocabulary
  10,000, captions of 10–23 tokens; ours beside sgrvinod's tutorial decoder (re-projects all
  196 locations every step) and beside the floor: the step's FLOPs at the measured matmul rate.
- prepare: feature extraction images/s on COCO-sized JPEGs, beside the bare VGG16 forward.
- caption: one image through `Captioner.caption` at beam 3, beside the bare VGG16 forward.
- scst: one self-critical step (sampling, CIDEr-D reward, backward, Adam) and the reward's share.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgrvinod_decoder import TutorialDecoder, tutorial_loss  # noqa: E402

from captioner.decoder import AttentionDecoder, sequence_loss  # noqa: E402
from captioner.encoder import EncoderSpec, build_encoder  # noqa: E402
from captioner.training import make_optimizer  # noqa: E402

B, L, D, V = 32, 196, 512, 10_000


def timed(fn, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fmt(ts: list[float]) -> str:
    return f"median {statistics.median(ts) * 1e3:8.1f} ms (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})"


def matmul_rate() -> float:
    """FLOP/s of float32 matmuls shaped like the decoder's (best of several)."""
    rates = []
    for m, k, n in ((512, 512, 10_000), (6272, 512, 512), (32, 1024, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = max(1, int(2e9 // (2 * m * k * n)))
        ts = timed(lambda: [a @ b for _ in range(reps)], 5)
        rates.append(2 * m * k * n * reps / min(ts))
    return max(rates)


def caption_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 24, (B,), generator=g)
    T = int(lengths.max())
    caps = torch.randint(4, V, (B, T), generator=g)
    caps[:, 0] = 1
    for b, n in enumerate(lengths):
        caps[b, n - 1] = 2
        caps[b, n:] = 0
    return torch.rand(B, L, D, generator=g), caps, lengths


def bench_decoder(steps: int) -> None:
    feats, caps, lengths = caption_batch()
    torch.manual_seed(0)
    ours = AttentionDecoder(vocab_size=V, encoder_dim=D, embed_dim=512, hidden_dim=512, attention_dim=512, dropout=0.5)
    theirs = TutorialDecoder(attention_dim=512, embed_dim=512, decoder_dim=512, vocab_size=V, encoder_dim=D)

    def training_step(loss, opt):
        def step():
            opt.zero_grad()
            loss().backward()
            opt.step()
        return step

    step_ours = training_step(lambda: sum(sequence_loss(ours, feats, caps, lengths)),  # what `fit` runs
                              make_optimizer(ours, 4e-4))
    step_theirs = training_step(lambda: tutorial_loss(theirs, feats, caps, lengths),  # as the tutorial runs it
                                torch.optim.Adam(theirs.parameters(), 4e-4))
    step_theirs_fused = training_step(lambda: tutorial_loss(theirs, feats, caps, lengths),  # same optimizer
                                      make_optimizer(theirs, 4e-4))

    with FlopCounterMode(display=False) as fc:
        sum(sequence_loss(ours, feats, caps, lengths)).backward()
    flops = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc2:
        tutorial_loss(theirs, feats, caps, lengths).backward()
    rate = matmul_rate()
    # Interleave the two so that machine noise hits both alike.
    t_ours, t_theirs, t_fused = [], [], []
    for _ in range(steps):
        t_ours += timed(step_ours, 1, warmup=1 if not t_ours else 0)
        t_theirs += timed(step_theirs, 1, warmup=1 if not t_theirs else 0)
        t_fused += timed(step_theirs_fused, 1, warmup=1 if not t_fused else 0)
    mo, mt, mf = statistics.median(t_ours), statistics.median(t_theirs), statistics.median(t_fused)
    print(f"decoder training step (B={B}, sizes 512, V={V}, captions 10-23 tokens, T={caps.shape[1]}),")
    print("forward, backward and Adam update, each as its training code runs it:")
    print(f"  captioner AttentionDecoder   {fmt(t_ours)}   {flops / 1e9:6.1f} GFLOP  (fused Adam, as `fit`)")
    print(f"  sgrvinod DecoderWithAttention {fmt(t_theirs)}   {fc2.get_total_flops() / 1e9:6.1f} GFLOP  (Adam, as the tutorial)")
    print(f"  sgrvinod, given our fused Adam {fmt(t_fused)}")
    print(f"  speed-up over sgrvinod: {mt / mo:.2f}x; over sgrvinod with the same optimizer: {mf / mo:.2f}x")
    print(f"  floor: {flops / 1e9:.1f} GFLOP at the measured matmul rate {rate / 1e9:.0f} GFLOP/s = "
          f"{flops / rate * 1e3:.1f} ms; ours is {mo / (flops / rate):.2f}x the floor")


def vgg_forward_rate(batch: int, repeats: int = 3) -> float:
    enc, _ = build_encoder(EncoderSpec(weights="none"))
    x = torch.randn(batch, 3, 224, 224)
    with torch.inference_mode():
        ts = timed(lambda: enc(x), repeats, warmup=1)
    return batch / statistics.median(ts)


def _photo_set(root: str, n: int) -> str:
    """n COCO-sized photos (640x480 JPEG with texture) and their captions file; returns its path."""
    import json

    from PIL import Image
    images = os.path.join(root, "images")
    os.makedirs(images)
    rs = np.random.RandomState(0)
    entries, anns = [], []
    for i in range(n):
        arr = (rs.rand(480 // 8, 640 // 8, 3) * 255).astype(np.uint8)
        Image.fromarray(arr).resize((640, 480), Image.BICUBIC).save(os.path.join(images, f"{i}.jpg"), quality=90)
        entries.append({"id": i + 1, "file_name": f"{i}.jpg"})
        anns.append({"id": i + 1, "image_id": i + 1, "caption": "a picture of noise"})
    caps = os.path.join(root, "captions.json")
    with open(caps, "w") as f:
        json.dump({"images": entries, "annotations": anns}, f)
    return caps


def bench_prepare(small: int = 32, large: int = 160) -> None:
    """Whole `prepare` runs on two set sizes: the difference is the steady rate, without the
    fixed start-up (building the encoder, starting workers, writing the vocabulary)."""
    from captioner.prepare import prepare
    rates = {b: vgg_forward_rate(b, repeats=max(3, 32 // b)) for b in (4, 8, 32)}
    best = max(rates, key=rates.get)
    took = {}
    for n in (small, large):
        with tempfile.TemporaryDirectory() as tmp:
            caps = _photo_set(tmp, n)
            t0 = time.perf_counter()
            prepare([caps], [os.path.join(tmp, "images")], os.path.join(tmp, "data"),
                    encoder=EncoderSpec(weights="none"), min_count=1, progress=False)
            took[n] = time.perf_counter() - t0
    steady = (large - small) / (took[large] - took[small])
    print(f"prepare (JPEGs of 640x480, default batch, 2 workers): {large} images in {took[large]:.1f} s "
          f"({large / took[large]:.2f} images/s with start-up); steady rate {steady:.2f} images/s "
          f"(from {small} vs {large} images)")
    print("  bare VGG16 forward: " + ", ".join(f"batch {b}: {r:.2f}" for b, r in rates.items()) + " images/s")
    print(f"  floor: the fastest, batch {best}: {rates[best]:6.2f} images/s; prepare's steady rate is "
          f"{steady / rates[best]:.2f}x of it")


def bench_caption(repeats: int) -> None:
    from PIL import Image

    from captioner import Captioner
    from captioner.assets import demo_checkpoint
    cap = Captioner.load(demo_checkpoint())
    rs = np.random.RandomState(1)
    img = Image.fromarray((rs.rand(480, 640, 3) * 255).astype(np.uint8))
    enc = cap.encoder
    x = cap.encoder_spec.preprocess(img).unsqueeze(0)
    with torch.inference_mode():
        t_vgg = timed(lambda: enc(x), repeats)
    t_cap = timed(lambda: cap.caption(img, beam_size=3), repeats)
    print("one 640x480 image, beam 3:")
    print(f"  Captioner.caption  {fmt(t_cap)}")
    print(f"  bare VGG16 forward {fmt(t_vgg)}")
    print(f"  ratio: {statistics.median(t_cap) / statistics.median(t_vgg):.2f}x the bare forward")


def bench_scst(steps: int, images: int = 32, samples: int = 5) -> None:
    """One `fit --objective scst` step at the default batch (32 images x 5 samples), sizes 512,
    V=10,000, 5 references of 10-23 tokens per image. An untrained model samples until max_len
    (20 words): the longest captions, so the most work for sampling and for the reward alike."""
    from captioner.cider import DocumentFrequency, NgramScorer, References
    from captioner.scst import ImageBatch, ScstConfig, SelfCritical
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 24, (images * 5,), generator=g)                  # 5 references per image
    refs = References(torch.randint(4, V, (images * 5, 24), generator=g), lengths,
                      torch.arange(images).repeat_interleave(5), base=V)
    scorer = NgramScorer(refs, DocumentFrequency.from_references(refs))
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=V, encoder_dim=D, embed_dim=512, hidden_dim=512, attention_dim=512, dropout=0.2)
    objective = SelfCritical(dec, ScstConfig(samples=samples), scorer, max_len=20)
    opt = make_optimizer(dec, 5e-5)
    batch = ImageBatch(torch.rand(images, L, D, generator=g), torch.arange(images))
    spent: list[float] = []
    reward = objective.reward

    def timed_reward(*args):
        t0 = time.perf_counter()
        out = reward(*args)
        spent.append(time.perf_counter() - t0)
        return out
    objective.reward = timed_reward

    def step():
        loss, _ = objective(batch, float(images), generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    t_step = timed(step, steps, warmup=1)
    t_reward = spent[-steps:]
    share = sum(t_reward) / sum(t_step)
    print(f"self-critical step ({images} images x {samples} samples = {images * samples} captions of "
          f"{objective.max_len} words + <end>, sizes 512, V={V}): sampling with gradients, CIDEr-D, backward, Adam")
    print(f"  whole step {fmt(t_step)}")
    print(f"  reward     {fmt(t_reward)}  ({share:.1%} of the step)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="decoder,prepare,caption,scst", help="comma-separated sections")
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per measurement")
    args = p.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    sections = args.only.split(",")
    if "decoder" in sections:
        bench_decoder(args.steps)
    if "prepare" in sections:
        bench_prepare()
    if "caption" in sections:
        bench_caption(args.steps)
    if "scst" in sections:
        bench_scst(args.steps)


if __name__ == "__main__":
    main()
