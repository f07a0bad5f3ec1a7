"""The GPU checks a CPU cannot make, each run as a user runs the commands, on a selfcheck's data:

- prepare: `train.py prepare --device cuda` writes the features `--device cpu` writes, row for row;
- resume: `fit --resume --cuda-graphs off` of a run that compiled its steps steps eagerly from there;
- broken compile: every compile failing (gpu_faults/sitecustomize.py), with dropout: `fit` trains on
  eagerly and says so, and `selfcheck` fails the mode.

    python benchmarks/gpu_checks.py WORK [--device cuda]     (WORK holds a selfcheck's scenes/ and data/)

Prints one line per check and writes WORK/gpu_checks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = [sys.executable, "-m", "captioner.cli.train"]


def run(command: list[str], log: str, env: dict | None = None) -> int:
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(command) + "\n")
        f.flush()
        return subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}).returncode


def events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    return [json.loads(x) for x in open(path, encoding="utf-8")] if os.path.exists(path) else []


def check_prepare(work: str, device: str, log: str) -> dict:
    """The same 48 images prepared on `device` and on the CPU."""
    scenes = os.path.join(work, "scenes")
    images = os.path.join(work, "prepare_images")
    os.makedirs(images, exist_ok=True)
    for name in sorted(os.listdir(os.path.join(scenes, "images")))[:48]:
        shutil.copy(os.path.join(scenes, "images", name), images)
    out = {}
    for where in (device, "cpu"):
        data = os.path.join(work, f"prepare_{where.replace(':', '_')}")
        shutil.rmtree(data, ignore_errors=True)
        args = ["prepare", "--images", images, "--captions", os.path.join(scenes, "captions.json"), "--out", data]
        args += ["--encoder-weights", "none", "--device", where, "--batch-size", "8", "--skip-missing"]
        out[where] = (run([*TRAIN, *args], log), data)
    if any(code for code, _ in out.values()):
        return {"passed": False, "why": f"prepare exited {[c for c, _ in out.values()]}"}
    a = np.load(os.path.join(out[device][1], "features.npy")).astype(np.float32)
    b = np.load(os.path.join(out["cpu"][1], "features.npy")).astype(np.float32)
    a2, b2 = a.reshape(len(a), -1), b.reshape(len(b), -1)
    cos = (a2 * b2).sum(1) / (np.linalg.norm(a2, axis=1) * np.linalg.norm(b2, axis=1) + 1e-12)
    rel = float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))
    return {"passed": bool(cos.min() > 0.999), "rows": len(a), "min_row_cosine": float(cos.min()), "max_rel_diff": rel}


def check_resume_graphs_off(work: str, device: str, log: str) -> dict:
    """A compiled run, stopped after an epoch, resumed with --cuda-graphs off."""
    data, out = os.path.join(work, "data"), os.path.join(work, "runs", "resume_off")
    shutil.rmtree(out, ignore_errors=True)
    fit = ["fit", "--data", data, "--out", out, "--device", device, "--val-images", "40", "--log-every", "1"]
    first = run([*TRAIN, *fit, "--epochs", "1"], log)
    second = run([*TRAIN, *fit, "--epochs", "2", "--resume", "--cuda-graphs", "off"], log)
    lines = events(out)
    starts = [i for i, x in enumerate(lines) if x.get("event") == "start"]
    if first or second or len(starts) < 2:
        return {"passed": False, "why": f"fit exited {first}, then {second}"}
    before = [x["message"] for x in lines[: starts[1]] if x.get("event") == "compiled"]
    after = [x["message"] for x in lines[starts[1] :] if x.get("event") == "compiled"]
    recorded = lines[starts[1]]["train"]
    return {
        "passed": any("training step" in m for m in before) and not any("training step" in m for m in after),
        "compiled_before": before[:4],
        "compiled_after": after[:4],
        "recorded_after": {k: v for k, v in _flat(recorded).items() if "graph" in k},
    }


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def check_broken_compile(work: str, device: str, log: str) -> dict:
    """fit, then selfcheck, with every compile failing."""
    broken = {
        "CAPTIONER_BREAK_COMPILE": "1",
        "PYTHONPATH": os.path.join(HERE, "gpu_faults") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    data, out = os.path.join(work, "data"), os.path.join(work, "runs", "broken_compile")
    shutil.rmtree(out, ignore_errors=True)
    fit = ["fit", "--data", data, "--out", out, "--device", device, "--val-images", "40", "--log-every", "1"]
    code = run([*TRAIN, *fit, "--epochs", "1", "--dropout", "0.5"], log, broken)
    lines = events(out)
    trained = [x["step"] for x in lines if x.get("event") == "train"]
    failed = [x.get("message", "")[:300] for x in lines if x.get("event") == "compiled_failed"]
    check = os.path.join(work, "selfcheck_broken")
    shutil.rmtree(check, ignore_errors=True)
    os.makedirs(check)
    for part in ("scenes", "data"):
        shutil.copytree(os.path.join(work, part), os.path.join(check, part))
    selfcheck = [sys.executable, "-m", "captioner", "selfcheck", "--device", device, "--seconds", "6"]
    sc_code = run([*selfcheck, "--work", check, "--only", "soft"], log, broken)
    last = os.path.exists(os.path.join(out, "last.pt"))
    return {
        "fit_exit": code,
        "fit_steps_logged": trained[-1] if trained else None,
        "fit_last_pt": last,
        "compiled_failed": failed[:3],
        "selfcheck_exit": sc_code,
        "passed": code == 0 and last and bool(failed) and sc_code != 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work")
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", default="prepare,resume,broken")  # broken: every compile failing
    args = p.parse_args()
    log = os.path.join(args.work, "gpu_checks.log")
    checks = {"prepare": check_prepare, "resume": check_resume_graphs_off, "broken": check_broken_compile}
    results = {}
    for name in args.only.split(","):
        try:
            results[name] = checks[name](args.work, args.device, log)
        except Exception as e:  # noqa: BLE001 - one check's failure is reported, the others still run
            results[name] = {"passed": False, "why": f"{type(e).__name__}: {e}"}
        print(f"{name:8s} {'passed' if results[name]['passed'] else 'FAILED'}  {results[name]}", flush=True)
    with open(os.path.join(args.work, "gpu_checks.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
