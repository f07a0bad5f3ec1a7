"""The VGG16 trunk to conv5_3, as captioning computes its features, by each path the encoder can take on a
CPU, under ATen's AVX2 and AVX-512 kernels, side by side.

    python benchmarks/encoder_paths.py [--rounds 3] [--repeats 5] [--capabilities avx2,avx512]
        [--cap-all]

Each round runs one process per capability, in turn (avx2, avx512, avx2, ...); inside a process the
paths alternate at one image (224×224) and at a batch of 8, so that machine noise hits them alike.
Medians over all rounds are printed per path, capability and batch, with each path's speed-up over
PyTorch's own (eager fp32). `--cap-all` also caps oneDNN and MKL at the capability (an AVX2 machine;
ATEN_CPU_CAPABILITY alone moves only ATen's own kernels).

Paths: eager fp32 (PyTorch's own, `Captioner(fast=False)`), eager channels-last, and `optimize_encoder`
with each of its options that exist in this checkout (`winograd`, where `FusedVGG` still takes it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

CAPS = {"avx2": "AVX2", "avx512": "AVX512_CORE"}  # ATen's name → oneDNN's
MKL = {"avx2": "AVX2", "avx512": "AVX512"}


def paths():
    import torch

    from captioner.models import fast_encoder
    from captioner.models.encoder import EncoderSpec, build_encoder

    plain, _ = build_encoder(EncoderSpec(weights="none"))
    out = {"eager fp32 (PyTorch)": plain}
    out["eager channels-last"] = fast_encoder._ChannelsLast(plain).eval()
    if "winograd" in inspect.signature(fast_encoder.optimize_encoder).parameters:
        out["optimize_encoder, oneDNN only"] = fast_encoder.optimize_encoder(plain, "cpu", winograd=False)
        out["optimize_encoder, oneDNN + Winograd"] = fast_encoder.optimize_encoder(plain, "cpu", winograd=True)
    else:
        out["optimize_encoder"] = fast_encoder.optimize_encoder(plain, "cpu")
    return torch, out


def child(repeats: int) -> None:
    torch, encoders = paths()
    g = torch.Generator().manual_seed(0)
    inputs = {b: torch.randn(b, 3, 224, 224, generator=g) for b in (1, 8)}
    times = {f"{name}|{b}": [] for name in encoders for b in inputs}
    with torch.inference_mode():
        ref = {b: encoders["eager fp32 (PyTorch)"](x) for b, x in inputs.items()}
        for name, enc in encoders.items():  # warm-up, and a check that each path gives the plain features
            for b, x in inputs.items():
                err = float((enc(x) - ref[b]).abs().max() / ref[b].abs().max())
                assert err < 1e-4, (name, b, err)
        for _ in range(repeats):
            for b, x in inputs.items():
                for name, enc in encoders.items():
                    t0 = time.perf_counter()
                    enc(x)
                    times[f"{name}|{b}"].append((time.perf_counter() - t0) * 1e3 / b)  # ms an image
    print(json.dumps(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--capabilities", default="avx2,avx512")
    p.add_argument("--cap-all", action="store_true", help="cap oneDNN and MKL too")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.repeats)
    caps = args.capabilities.split(",")
    results: dict[str, dict[str, list[float]]] = {c: {} for c in caps}
    for r in range(args.rounds):
        for cap in caps if r % 2 == 0 else caps[::-1]:
            env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
            if args.cap_all:
                env |= {"ONEDNN_MAX_CPU_ISA": CAPS[cap], "MKL_ENABLE_INSTRUCTIONS": MKL[cap]}
            cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            for key, ts in json.loads(out.splitlines()[-1]).items():
                results[cap].setdefault(key, []).extend(ts)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cap-all={args.cap_all}, ms an image:")
    for cap in caps:
        for b in (1, 8):
            base = statistics.median(results[cap][f"eager fp32 (PyTorch)|{b}"])
            for key, ts in results[cap].items():
                name, batch = key.split("|")
                if int(batch) == b:
                    m = statistics.median(ts)
                    print(
                        f"  {cap:7s} batch {b}  {name:38s} median {m:7.1f}  (min {min(ts):6.1f}, "
                        f"max {max(ts):6.1f}, n={len(ts)})  {base / m:5.2f}x eager"
                    )


if __name__ == "__main__":
    main()
