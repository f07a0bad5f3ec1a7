"""`captioner selfcheck`: a training mode of each kind, run briefly as a user runs it, on this machine's CPU."""

from __future__ import annotations

import pytest
from conftest import run_cli

from captioner.cli.selfcheck import modes

# One mode of each kind, run by `selfcheck` on the CPU as on a GPU (fit, evaluate, export, caption). The
# others differ from one of these by an option that a test of its own trains on the CPU: SCST's mean-of-others
# baseline (test_scst), --boxes-choice-weight (test_correctness), conv4_1 and boxes when fine-tuning
# (test_finetune), a cross-entropy step in bf16 (test_finetune; bf16-scst runs autocast here), torchrun
# (test_distributed, two processes), a ResNet-101 prepared, fine-tuned, exported and captioned
# (test_backbones), --compile (test_compiled: Inductor's step against the eager one; test_distributed:
# torchrun compiling under DDP). A GPU session runs them all.
ON_THE_CPU = ["soft", "hard", "scst-greedy", "boxes", "tune-conv5_1", "bf16-scst"]


@pytest.mark.slow
def test_a_mode_of_each_kind_passes_on_the_cpu(tmp_path):
    work = ["--work", str(tmp_path), "--only", *ON_THE_CPU]
    p = run_cli("-m", "captioner", "selfcheck", "--device", "cpu", "--scenes", "60", "--seconds", "3", *work)
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line and not line.startswith("selfcheck")}
    assert set(ON_THE_CPU) < {m.name for m in modes("boxes.json")}
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert all(" passed " in lines[name] + " " for name in ["prepare", *ON_THE_CPU]), p.stdout
    assert set(lines) == {"prepare", *ON_THE_CPU}
    assert "steps/s" in lines["soft"]


@pytest.mark.slow
def test_a_failing_mode_is_named_and_its_log_kept(tmp_path):
    p = run_cli(
        "-m", "captioner", "selfcheck", "--device", "cpu", "--scenes", "30", "--work", str(tmp_path), "--only", "scst"
    )
    assert p.returncode == 1 and "scst" in p.stdout and "FAILED  needs the soft mode's model" in p.stdout
    assert (tmp_path / "selfcheck.log").exists()
