"""`captioner selfcheck`: every training mode, run briefly as a user runs it, on this machine's CPU."""

from __future__ import annotations

import pytest
from conftest import run_cli

from captioner.cli.selfcheck import modes


@pytest.mark.slow
def test_every_mode_passes_on_the_cpu(tmp_path):
    p = run_cli(
        "-m", "captioner", "selfcheck", "--device", "cpu", "--scenes", "60", "--seconds", "3", "--work", str(tmp_path)
    )
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line and not line.startswith("selfcheck")}
    names = ["prepare"] + [m.name for m in modes("boxes.json")]
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert all(" passed " in lines[name] + " " for name in names), p.stdout
    assert "steps/s" in lines["soft"]


@pytest.mark.slow
def test_a_failing_mode_is_named_and_its_log_kept(tmp_path):
    p = run_cli(
        "-m", "captioner", "selfcheck", "--device", "cpu", "--scenes", "30", "--work", str(tmp_path), "--only", "scst"
    )
    assert p.returncode == 1 and "scst" in p.stdout and "FAILED  needs the soft mode's model" in p.stdout
    assert (tmp_path / "selfcheck.log").exists()
