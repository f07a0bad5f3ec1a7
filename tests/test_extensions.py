"""What each kind of extension takes, proved by adding one: a loss term is its class and one line in
`objectives.objective.TERMS`; a decoding method is its routine and two lines, one in `decoding.settings.METHODS`
(what it reads, for the API, the command line and the page) and one in `decoding.decode.ROUTINES` (here each
"line" is the monkeypatch that adds it). A backbone is its row in `models.backbones.BACKBONES`
(with a `draw` where its family is new): ConvNeXt-T, tests/test_backbones.py. docs/design.md lists them.
"""

from __future__ import annotations

import json

import torch

from captioner.decoding import decode, settings
from captioner.decoding.beams import hypotheses
from captioner.decoding.search_state import Search, step_logits
from captioner.models.decoder import DecoderConfig
from captioner.models.vocab import END_ID, PAD_ID
from captioner.objectives import objective
from captioner.objectives.terms import Term
from captioner.serve.sources import demo_model, example_images
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit

# a loss term


class Spread(Term):
    """A toy term: how far each map is from uniform, Σ_l α_tl² per word (which the model could learn to lower)."""

    name = "spread"

    @classmethod
    def make(cls, cfg, setup):
        return cls(0.01)

    def __call__(self, ctx):
        p = ctx.passed
        return ((p.unrolled.alphas**2).sum(-1) * p.mask).sum() / ctx.words


def test_a_new_loss_term_is_its_class_and_one_line(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(objective, "TERMS", [*objective.TERMS, Spread])  # the one line
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, val_images=4, log_every=1)
    small = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12)
    fit(FitJob(str(data_dir), str(tmp_path / "run"), small, cfg, device="cpu", progress_bar=False))
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8")]
    spread = [x["spread"] for x in lines if x["event"] == "train"]
    assert spread and all(0 < s < float("inf") for s in spread)


# a decoding method

PENALTY = 1e4  # what a word already written loses of its log-probability: no word twice


def penalised_greedy(decoder, features, s, max_len, generator, compiled):
    """Greedy decoding that holds back words already written: each step's likeliest word after a penalty."""
    state = Search.start(decoder, features, 1, max_len + 1)
    state.scores.zero_()
    N, V = state.words.size(0), decoder.config.vocab_size
    t, last = torch.zeros((), dtype=torch.long), torch.full((), max_len)
    written = torch.zeros(N, V)  # (N, V) 1 where a word was written
    for k in range(max_len + 1):
        logits, h, c, alpha, _, ban = step_logits(decoder, state, state.words, state.h, state.c, t, last,
                                                  s.context, None, s.sharpness)  # fmt: skip
        logp = logits.float().log_softmax(-1) + ban  # (N, V)
        words = torch.where(state.finished, PAD_ID, (logp - PENALTY * written).argmax(-1))  # (N,)
        state.scores.view(-1).add_(torch.where(state.finished, 0.0, logp.gather(1, words[:, None]).squeeze(1)))
        state.word[k], state.alpha[k], state.h, state.c, state.words = words, alpha, h, c, words
        written[torch.arange(N), words] = 1.0
        state.finished |= words == END_ID
        t += 1
    history = (state.word.T, state.alpha.transpose(0, 1), state.loc.T, state.scores)
    return hypotheses(*(x.numpy() for x in history), max_len)


def test_a_new_decoding_method_is_its_routine_and_two_lines(monkeypatch, capsys):
    """The method from the API, `captioner caption --decoding` and the demo's /caption, the same caption each."""
    from captioner import Captioner
    from captioner.cli.main import main
    from captioner.demo.handlers import Demo

    monkeypatch.setitem(settings.METHODS, "penalised", settings.Method(()))  # the two lines
    monkeypatch.setitem(decode.ROUTINES, "penalised", penalised_greedy)
    image = example_images()[1]
    cap = Captioner.load(demo_model())
    api = cap.caption(image, method="penalised")
    assert api.words and len(set(api.words)) == len(api.words)  # no word twice
    assert api.attention.shape == (len(api.words), 14, 14)
    main(["caption", image, "--decoding", "penalised", "--device", "cpu", "--no-progress"])
    assert capsys.readouterr().out.strip().split("\t")[1] == api.text
    assert Demo(cap, method="penalised").caption(image, 3)[0] == api.text


def test_the_page_draws_a_control_for_each_setting_its_method_reads(monkeypatch):
    """The page's decoding controls come from the method's `reads`: sampling's four, beam's two, and for a
    method that reads none only the beam slider /caption needs, hidden."""
    import gradio as gr

    from captioner.demo.app import _controls

    monkeypatch.setitem(settings.METHODS, "penalised", settings.Method(()))
    with gr.Blocks():
        shown = {
            m: {k: c for k, c in _controls(settings.Decoding(method=m)).items() if c.visible} for m in settings.METHODS
        }
        penalised = _controls(settings.Decoding(method="penalised"))
    assert set(shown["sampling"]) == {"temperature", "top_k", "top_p", "n"}
    assert isinstance(shown["beam"]["beam_size"], gr.Slider) and isinstance(shown["beam"]["length_norm"], gr.Checkbox)
    assert shown["sampling"]["top_p"].info.startswith("sampling: draw only among the fewest likeliest words")
    assert shown["penalised"] == {} and list(penalised) == ["beam_size"]
