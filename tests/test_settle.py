"""Settings settled once: every default that depends on other settings is decided by `train.settle`."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
import torch

from captioner.cli.train import get_parser
from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.options import command_line, from_args
from captioner.train.config import GROUPS, TrainConfig
from captioner.train.finetune import DECODER_FIRST, FineTuneConfig
from captioner.train.settle import settle

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Every field whose default is decided from other settings, and the fields that are optional on purpose.
DERIVED_FIELDS = {"lr", "dropout", "alpha_c", "consistency", "word_query", "decode_sharpness", "after"}
DERIVED = DERIVED_FIELDS | {"shapes"}  # shapes: "auto", which its help explains
OPTIONAL = {"boxes", "max_minutes", "init", "fine_tune", "cuda_graphs"}  # cuda_graphs "auto": where they can be


INIT = {"decoder": DecoderConfig(9).to_dict()}  # an --init checkpoint, as settle reads it


def settled(model=None, device=CPU, init=None, **train):
    return settle(model, TrainConfig.of(**train), vocab_size=9, device=device, init=init)


def undecided(config) -> set[str]:
    """Fields left None (or "auto"), in a config and its groups."""
    out = set()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out |= undecided(value)
        elif value is None or value == "auto":
            out.add(f.name)
    return out


def test_the_derived_defaults_are_these_and_settle_leaves_none_undecided():
    given = TrainConfig(fine_tune=FineTuneConfig())
    assert undecided(given) | undecided(DecoderConfig(9)) == DERIVED | OPTIONAL - {"fine_tune"}
    model, cfg = settle(None, given, vocab_size=9, device=CPU)
    assert not (undecided(model) | undecided(cfg)) - OPTIONAL
    assert set(GROUPS) == {"optim", "schedule", "checkpoints", "terms", "hard", "scst"}


def test_each_derived_default():
    model, cfg = settled()
    assert (cfg.optim.lr, model.dropout, cfg.terms.alpha_c, cfg.terms.consistency) == (1e-3, 0.2, 0.3, 1.0)
    assert (model.word_query, model.decode_sharpness, cfg.optim.shapes) == (False, 1.0, "packed")
    assert settled(objective="scst", init=INIT)[1].optim.lr == 5e-5
    assert settled(DecoderConfig(0, attention="hard"))[0].dropout == 0.5
    boxed, _ = settled(boxes="b.json")
    assert boxed.word_query and boxed.decode_sharpness == 3.0
    hard_boxed, _ = settled(DecoderConfig(0, attention="hard"), boxes="b.json")
    assert hard_boxed.word_query and hard_boxed.decode_sharpness == 1.0
    paper, paper_cfg = settled(boxes="b.json", paper=True)
    assert (paper.word_query, paper.decode_sharpness) == (False, 1.0)
    assert (paper_cfg.terms.alpha_c, paper_cfg.terms.consistency) == (1.0, 0.0)
    assert settled(device=CUDA)[1].optim.shapes == "fixed"
    assert settled(compile=True)[1].optim.shapes == "fixed"
    assert settled(fine_tune=FineTuneConfig())[1].fine_tune.after == DECODER_FIRST


def test_given_values_win_and_configs_are_frozen():
    model, cfg = settled(DecoderConfig(0, dropout=0.4, word_query=True), lr=0.5, alpha_c=0.0, shapes="fixed")
    assert (model.dropout, model.word_query, cfg.optim.lr, cfg.terms.alpha_c, cfg.optim.shapes) == (
        0.4,
        True,
        0.5,
        0.0,
        "fixed",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0
    with pytest.raises(CaptionerError, match="--compile trains with fixed shapes"):
        settled(compile=True, shapes="packed")


def test_init_takes_the_checkpoints_decoder_and_its_sharpness_unless_given():
    init = {"decoder": DecoderConfig(9, embed_dim=8, dropout=0.1, word_query=True, decode_sharpness=2.0).to_dict()}
    model, cfg = settle(
        DecoderConfig(0, embed_dim=64),
        TrainConfig.of(init="run/best.pt", fine_tune=FineTuneConfig()),
        vocab_size=9,
        device=CPU,
        init=init,
    )
    assert (model.embed_dim, model.dropout, model.decode_sharpness) == (8, 0.1, 2.0)
    assert cfg.fine_tune.after == 0  # the decoder is trained already
    model, _ = settle(DecoderConfig(0, decode_sharpness=4.0), TrainConfig(), vocab_size=9, device=CPU, init=init)
    assert model.decode_sharpness == 4.0


def test_the_paper_objective_refuses_options_that_contradict_it():
    with pytest.raises(CaptionerError, match="--paper-objective trains with --alpha-c 1 and --consistency 0"):
        settled(paper=True, alpha_c=0.3)
    with pytest.raises(CaptionerError, match="--consistency 0.5"):
        settled(paper=True, consistency=0.5)
    assert settled(paper=True, alpha_c=1.0, consistency=0.0)[1].terms.alpha_c == 1.0  # the same values: fine
    args = get_parser().parse_args(["fit", "--data", "d", "--out", "o", "--paper-objective", "--alpha-c", "0.3"])
    with pytest.raises(CaptionerError):
        settle(None, from_args(TrainConfig, args), vocab_size=9, device=CPU)


def test_a_resumed_run_keeps_its_settings_but_how_long_and_how_often():
    model, cfg = settled(lr=0.01, epochs=3, boxes="b.json")
    saved = {"decoder": model.to_dict(), "train": cfg.to_dict()}
    command = TrainConfig.of(epochs=9, lr=0.5, log_every=3, checkpoint_every=7, boxes=None)
    model2, cfg2 = settle(None, command, vocab_size=9, device=CPU, saved=saved)
    assert model2 == model
    assert (cfg2.optim.lr, cfg2.terms.boxes, cfg2.schedule.epochs) == (0.01, "b.json", 9)
    assert (cfg2.checkpoints.log_every, cfg2.checkpoints.checkpoint_every) == (3, 7)


def test_fit_help_is_grouped_by_concern():
    text = get_parser()._subparsers._group_actions[0].choices["fit"].format_help()
    for title in ("Optimisation", "Schedule", "Checkpoints and logs", "Attention terms", "Hard attention"):
        assert f"\n{title}" in text, title
    assert "ms" not in text.split() and "docs/" not in text


def test_a_setting_name_in_two_groups_is_refused_when_the_config_is_defined():
    """`TrainConfig.of` and the command line find a setting's group by its name: two groups may not share one."""
    from dataclasses import dataclass, field

    from captioner.train.config import _groups

    @dataclass(frozen=True)
    class A:
        lr: float = 1.0

    @dataclass(frozen=True)
    class B:
        lr: float = 2.0

    @dataclass(frozen=True)
    class Both:
        a: A = field(default_factory=A)
        b: B = field(default_factory=B)

    with pytest.raises(TypeError, match="'lr' is in both a and b"):
        _groups(Both)
    assert set(GROUPS) == {"optim", "schedule", "checkpoints", "terms", "hard", "scst"}


def test_without_views_the_consistency_is_settled_off_unless_a_fine_tuned_encoder_makes_them():
    plain = settle(None, TrainConfig(), vocab_size=9, device=CPU, views=False)[1]
    tuned = settle(None, TrainConfig(fine_tune=FineTuneConfig()), vocab_size=9, device=CPU, views=False)[1]
    assert (plain.terms.consistency, tuned.terms.consistency) == (0.0, 1.0)


# Every refusal of `fit`'s options: (decoder options, training options, the checkpoint resumed, the message's mark).
XE_RUN = {"decoder": DecoderConfig(9).to_dict(), "train": TrainConfig().to_dict()}
TUNED_RUN = {**XE_RUN, "train": TrainConfig(fine_tune=FineTuneConfig()).to_dict()}
REFUSALS = [
    (None, {"objective": "scst"}, None, "--init RUN/best.pt"),
    (None, {"objective": "scst", "init": "best.pt", "fine_tune": FineTuneConfig()}, None, "--fine-tune-encoder"),
    (DecoderConfig(0, attention="hard"), {"boxes": "b.json", "boxes_choice_weight": 1.0}, None, "--boxes-choice"),
    (None, {"compile": True, "shapes": "packed"}, None, "--compile trains with fixed shapes"),
    (None, {"paper": True, "alpha_c": 0.3}, None, "--paper-objective trains with --alpha-c 1"),
    (None, {"objective": "scst"}, XE_RUN, "cross-entropy run"),
    (None, {"fine_tune": FineTuneConfig()}, XE_RUN, "without --fine-tune-encoder"),
    (None, {"fine_tune": FineTuneConfig(start="conv4_1")}, TUNED_RUN, "with other --fine-tune-encoder"),
]


@pytest.mark.parametrize("model, train, saved, refused", REFUSALS)
def test_every_refusal_is_made_by_settle_before_anything_is_built(model, train, saved, refused):
    """A refusal is written once, in `settle`, which `fit` calls before it builds anything: each is
    listed here, and settle alone raises it, from the options and the checkpoints read."""
    init = INIT if train.get("init") else None
    with pytest.raises(CaptionerError, match=refused):
        settle(model, TrainConfig.of(**train), vocab_size=9, device=CPU, init=init, saved=saved)


def test_a_refused_fit_leaves_no_trace(data_dir, tmp_path):
    """`fit` refuses before it writes: no run directory, no pool4 cache in the data directory."""
    from captioner.train.loop import fit

    before = sorted(p.name for p in data_dir.iterdir())
    cfg = TrainConfig.of(objective="scst", init=None, fine_tune=FineTuneConfig())
    with pytest.raises(CaptionerError, match="--init"):
        fit(str(data_dir), str(tmp_path / "run"), None, cfg, device="cpu", progress_bar=False)
    assert not (tmp_path / "run").exists() and sorted(p.name for p in data_dir.iterdir()) == before


def _another_value(f: dataclasses.Field, hint):
    """A value of a setting other than its default, as a user could give it."""
    default = f.default
    bare = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
    if typing.get_origin(bare) in (typing.Union, types.UnionType):  # X | None
        bare = next(a for a in typing.get_args(bare) if a is not type(None))
    if typing.get_origin(bare) is typing.Literal:
        return next(c for c in typing.get_args(bare) if c != default and c != "auto")
    if bare is bool:
        return not default
    if bare is int:
        return (default or 0) + 2
    if bare is float:
        return 0.5 if default in (None, 0.0) else default / 2
    return "given.json"


def test_every_setting_is_an_option_written_once():
    """A new setting is one field of a group: `fit --help` offers it, the command line sets it, and the
    command each checkpoint records (`options.command_line`) gives it back, with no other place to edit."""
    given = {}
    for group in GROUPS.values():
        hints = typing.get_type_hints(group, include_extras=True)
        given |= {f.name: _another_value(f, hints[f.name]) for f in dataclasses.fields(group)}
    cfg = TrainConfig.of(**given, fine_tune=FineTuneConfig(start="conv4_1", lr=0.5, workers=3, after=1))
    args = ["fit", "--data", "d", "--out", "o", *command_line(cfg)]
    assert from_args(TrainConfig, get_parser().parse_args(args)) == cfg


def test_fit_help_says_each_derived_default_as_settle_settles_it():
    """A derived default is written once, in `settle.DERIVED`: every field settle derives has its rule
    there, and `fit --help` shows that rule, not a copy of it."""
    from captioner.train.settle import DERIVED

    assert set(DERIVED) == DERIVED_FIELDS
    text = " ".join(get_parser()._subparsers._group_actions[0].choices["fit"].format_help().split())
    for rule in DERIVED.values():
        assert f"(default: {' '.join(rule.split())})" in text, rule
