"""What a failed CUDA graph does, checked where a CPU can show it with stand-ins for the graphs:

- refused before CUDA began the capture: that shape goes on without a graph (tests/test_gpu_paths.py);
- failed inside CUDA (`CaptureBroken`): `fit` saves last.pt as of the last whole step and ends with one
  line naming `--resume --cuda-graphs off`, which then goes on to the losses of a run that never had
  graphs; a search raises rather than going on;
- `captioner selfcheck` fails a mode in which a graph fell back, naming it.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import captioner.train.parts as parts_module
from captioner.cli import selfcheck
from captioner.cuda_graphs import FELL_BACK, CaptureBroken
from captioner.decoding import graphed_search
from captioner.decoding.decode import beam_search
from captioner.errors import CaptionerError
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.train.config import TrainConfig
from captioner.train.loop import fit

SMALL = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.1)


class StandIn:
    """A graph maker for the CPU whose capture fails: `broken` inside CUDA, else refused before it began."""

    def __init__(self, device=None, broken: bool = True):
        self.broken, self.captured = broken, 0

    @staticmethod
    def supported(device) -> bool:
        return True

    def side(self):
        return contextlib.nullcontext()

    def capture(self, fn, generators=(), *, what="a CUDA graph"):
        self.captured += 1
        if self.broken:
            raise CaptureBroken(f"the capture of {what} failed inside CUDA (injected)")
        raise RuntimeError("injected refusal")


def _fit(data_dir, out, **settings):
    cfg = TrainConfig.of(
        epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, val_images=4, log_every=1, shapes="fixed", seed=3, **settings
    )
    fit(str(data_dir), str(out), SMALL, cfg, device="cpu", progress_bar=False, resume=(out / "last.pt").exists())
    return [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]


def _losses(lines):
    return [(x["step"], x["loss"]) for x in lines if x["event"] == "train"]


def test_a_capture_broken_inside_cuda_ends_fit_and_resume_without_graphs_goes_on(data_dir, tmp_path, monkeypatch):
    eager = _losses(_fit(data_dir, tmp_path / "eager", cuda_graphs="off"))
    graphs = StandIn()
    monkeypatch.setattr(parts_module, "GraphCapture", lambda device: graphs)
    run = tmp_path / "broken"
    with pytest.raises(CaptionerError, match=r"fit --resume --cuda-graphs off") as e:
        _fit(data_dir, run)
    assert "inside CUDA" in str(e.value) and graphs.captured == 1
    lines = [json.loads(x) for x in open(run / "metrics.jsonl", encoding="utf-8")]
    broken = [x for x in lines if x["event"] == "graph_broken"]
    assert len(broken) == 1 and (run / "last.pt").exists()
    assert 0 < broken[0]["step"] < eager[-1][0]
    resumed = _fit(data_dir, run, cuda_graphs="off")
    assert graphs.captured == 1  # graphs off: nothing captured after the resume
    assert [s for s, _ in _losses(resumed)] == [s for s, _ in eager]
    assert [v for _, v in _losses(resumed)] == pytest.approx([v for _, v in eager], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("broken", [True, False])
def test_a_search_whose_capture_broke_stops_and_a_refused_one_goes_on(monkeypatch, caplog, broken):
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=12, embed_dim=8, hidden_dim=8, attention_dim=8).eval()
    feats = torch.randn(2, 196, 512)
    want = beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed", graphs=False)

    class Graphs(StandIn):
        def __init__(self, device):
            super().__init__(device, broken=broken)

    monkeypatch.setattr(graphed_search, "GraphCapture", Graphs)
    with torch.inference_mode():
        if broken:
            with pytest.raises(CaptureBroken):
                beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed")
            return
        got = beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed")
    assert [[h.tokens for h in b] for b in got] == [[h.tokens for h in b] for b in want]
    assert any(FELL_BACK in r.getMessage() for r in caplog.records)


def test_selfcheck_fails_a_mode_in_which_a_graph_fell_back(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "graph_failed", "message": "shape (8, 23)"}) + "\n"
    )
    with pytest.raises(RuntimeError, match=r"shape \(8, 23\)"):
        selfcheck._graph_failures(str(tmp_path))
    with open(tmp_path / "log", "w") as log, pytest.raises(RuntimeError, match="fell back: the search"):
        selfcheck._run(["python", "-c", f"print('warning: {FELL_BACK}: the search x')"], log)


def test_batches_of_any_size_share_a_few_search_shapes():
    """The demo's batcher makes batches of 1 to 8 images: padded to powers of two, they need four search
    graphs, not eight, and the real images' captions are those of the batch unpadded."""
    from captioner.serve.api import _padded

    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=12, embed_dim=8, hidden_dim=8, attention_dim=8).eval()
    feats = torch.randn(5, 196, 512)
    assert {_padded(feats[:b]).size(0) for b in range(1, 9)} == {1, 2, 4, 8}
    with torch.inference_mode():
        plain = beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed")
        padded = beam_search(decoder, _padded(feats), beam_size=2, max_len=6, shapes="fixed")[:5]
    assert [[h.tokens for h in b] for b in padded] == [[h.tokens for h in b] for b in plain]


def test_a_cuda_error_is_said_in_one_line():
    from captioner.cuda_graphs import first_line

    error = RuntimeError("CUDA error: operation failed due to a previous error during capture\nSearch for ...\n")
    assert first_line(error) == "RuntimeError: CUDA error: operation failed due to a previous error during capture"
