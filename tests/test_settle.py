"""Settings settled once: every default that depends on other settings is decided by `train.resume.settle`."""

from __future__ import annotations

import dataclasses
import re
import types
import typing

import pytest
import torch

from captioner.cli.train import get_parser
from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.options import command_line, from_args
from captioner.train.config import GROUPS, ProcessConfig, TrainConfig
from captioner.train.finetune import DECODER_FIRST, FineTuneConfig
from captioner.train.resume import Start, settle

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# Every field whose default is decided from other settings, and the fields that are optional on purpose.
DERIVED_FIELDS = {"lr", "dropout", "alpha_c", "consistency", "word_query", "decode_sharpness", "after"}
DERIVED = DERIVED_FIELDS | {"shapes"}  # shapes: "auto", which its help explains
OPTIONAL = {"max_minutes", "fine_tune", "cuda_graphs", "tensorboard"}  # cuda_graphs "auto": where they can be


INIT = {"decoder": DecoderConfig(9).to_dict()}  # an --init checkpoint, as settle reads it


def settled(model=None, device=CPU, init=None, boxes=False, **train):
    return settle(model, TrainConfig.of(**train), Start(9, init=init, boxes=boxes), device)


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
    model, cfg = settle(None, given, Start(9), CPU)
    assert not (undecided(model) | undecided(cfg)) - OPTIONAL
    assert set(GROUPS) == {"optim", "process", "schedule", "terms", "hard", "scst"}


def test_each_derived_default():
    model, cfg = settled()
    assert (cfg.optim.lr, model.dropout, cfg.terms.alpha_c, cfg.terms.consistency) == (1e-3, 0.2, 0.3, 1.0)
    assert (model.word_query, model.decode_sharpness, cfg.process.shapes) == (False, 1.0, "packed")
    assert settled(objective="scst", init=INIT)[1].optim.lr == 5e-5
    assert settled(DecoderConfig(0, attention="hard"))[0].dropout == 0.5
    boxed, _ = settled(boxes=True)
    assert boxed.word_query and boxed.decode_sharpness == 3.0
    hard_boxed, _ = settled(DecoderConfig(0, attention="hard"), boxes=True)
    assert hard_boxed.word_query and hard_boxed.decode_sharpness == 1.0
    hard_mapped, _ = settled(DecoderConfig(0, attention="hard"), boxes=True, word_maps=True)
    assert hard_mapped.word_query and hard_mapped.decode_sharpness == 3.0
    paper, paper_cfg = settled(boxes=True, paper=True)
    assert (paper.word_query, paper.decode_sharpness) == (False, 1.0)
    assert (paper_cfg.terms.alpha_c, paper_cfg.terms.consistency) == (1.0, 0.0)
    assert settled(device=CUDA)[1].process.shapes == "fixed"
    assert settled(compile=True)[1].process.shapes == "fixed"
    assert settled(fine_tune=FineTuneConfig())[1].fine_tune.after == DECODER_FIRST


def test_given_values_win_and_configs_are_frozen():
    model, cfg = settled(DecoderConfig(0, dropout=0.4, word_query=True), lr=0.5, alpha_c=0.0, shapes="fixed")
    assert (model.dropout, model.word_query, cfg.optim.lr, cfg.terms.alpha_c, cfg.process.shapes) == (
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
        DecoderConfig(0, embed_dim=64), TrainConfig.of(fine_tune=FineTuneConfig()), Start(9, init=init), CPU
    )
    assert (model.embed_dim, model.dropout, model.decode_sharpness) == (8, 0.1, 2.0)
    assert cfg.fine_tune.after == 0  # the decoder is trained already
    model, _ = settle(DecoderConfig(0, decode_sharpness=4.0), TrainConfig(), Start(9, init=init), CPU)
    assert model.decode_sharpness == 4.0


def test_the_paper_objective_refuses_options_that_contradict_it():
    with pytest.raises(CaptionerError, match="--paper-objective trains with --alpha-c 1 and --consistency 0"):
        settled(paper=True, alpha_c=0.3)
    with pytest.raises(CaptionerError, match="--consistency 0.5"):
        settled(paper=True, consistency=0.5)
    assert settled(paper=True, alpha_c=1.0, consistency=0.0)[1].terms.alpha_c == 1.0  # the same values: fine
    args = get_parser().parse_args(["fit", "--data", "d", "--out", "o", "--paper-objective", "--alpha-c", "0.3"])
    with pytest.raises(CaptionerError):
        settle(None, from_args(TrainConfig, args), Start(9), CPU)


def test_a_resumed_run_keeps_its_settings_but_how_long_and_how_often():
    model, cfg = settled(lr=0.01, epochs=3, boxes=True)
    saved = {"decoder": model.to_dict(), "train": cfg.to_dict()}
    command = TrainConfig.of(epochs=9, lr=0.5, log_every=3, checkpoint_every=7)
    model2, cfg2 = settle(None, command, Start(9, saved=saved, boxes=True), CPU)
    assert model2 == model and model2.word_query
    assert (cfg2.optim.lr, cfg2.process.epochs) == (0.01, 9)
    assert (cfg2.process.log_every, cfg2.process.checkpoint_every) == (3, 7)


# What a resumed run takes from its own command: how this process runs the training, and how far it goes.
PER_PROCESS = {"shapes", "compile", "cuda_graphs", "epochs", "max_minutes", "workers"} | {
    "checkpoint_every",
    "checkpoint_minutes",
    "log_every",
    "tensorboard",
}


def test_how_a_process_runs_the_training_is_one_group():
    assert {f.name for f in dataclasses.fields(ProcessConfig)} == PER_PROCESS


def test_a_resumed_run_takes_how_this_process_runs_it_from_its_command():
    """The obvious way out of a misbehaving GPU run is to stop it and resume with --cuda-graphs off."""
    model, cfg = settled()
    saved = {"decoder": model.to_dict(), "train": cfg.to_dict()}
    assert (cfg.process.cuda_graphs, cfg.process.shapes) == ("auto", "packed")
    _, off = settle(None, TrainConfig.of(cuda_graphs="off"), Start(9, saved=saved), CPU)
    assert off.process.cuda_graphs == "off"
    _, on_gpu = settle(None, TrainConfig(), Start(9, saved=saved), CUDA)
    assert on_gpu.process.shapes == "fixed"  # --shapes auto follows the device this process trains on
    _, compiled = settle(None, TrainConfig.of(compile=True), Start(9, saved=saved), CPU)
    assert (compiled.process.compile, compiled.process.shapes) == (True, "fixed")
    with pytest.raises(CaptionerError, match="--compile trains with fixed shapes"):
        settle(None, TrainConfig.of(compile=True, shapes="packed"), Start(9, saved=saved), CPU)


def test_a_resumed_run_takes_from_its_command_only_the_per_process_settings():
    """Every setting given otherwise on resume: the run keeps its own but for those of how this process runs it."""
    model, cfg = settled(fine_tune=FineTuneConfig())
    saved = {"decoder": model.to_dict(), "train": cfg.to_dict()}
    given = {}
    for group in GROUPS.values():
        hints = typing.get_type_hints(group, include_extras=True)
        given |= {f.name: _another_value(f, hints[f.name]) for f in dataclasses.fields(group)}
    given["shapes"] = "fixed"  # with --compile
    command = TrainConfig.of(**given, fine_tune=FineTuneConfig(after=7))
    _, resumed = settle(None, command, Start(9, saved=saved), CPU)
    changed = {
        f.name
        for name in [*GROUPS, "fine_tune"]
        for f in dataclasses.fields(getattr(cfg, name))
        if getattr(getattr(resumed, name), f.name) != getattr(getattr(cfg, name), f.name)
    }
    assert changed == PER_PROCESS
    assert resumed.fine_tune.after == cfg.fine_tune.after and resumed.objective == cfg.objective


def test_a_resumed_run_keeps_its_model_and_optimisation_and_says_what_it_leaves_out(caplog):
    model, cfg = settled(lr=0.01)
    saved = {"decoder": model.to_dict(), "train": cfg.to_dict()}
    command = TrainConfig.of(lr=0.5, batch_size=16, cuda_graphs="off")
    model2, cfg2 = settle(DecoderConfig(0, attention="hard"), command, Start(9, saved=saved), CPU)
    assert (model2, cfg2.optim.lr, cfg2.optim.batch_size, cfg2.process.cuda_graphs) == (model, 0.01, 32, "off")
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "--attention hard" in warned and "--lr 0.5" in warned and "--batch-size 16" in warned
    assert "cuda-graphs" not in warned


def test_a_resumed_run_settles_the_derived_settings_its_checkpoint_lacks():
    """A setting added after a checkpoint was saved is derived on resume as on a fresh start, in every group."""
    model, cfg = settled()
    saved = {"decoder": model.to_dict(), "train": cfg.to_dict()}
    del saved["decoder"]["dropout"], saved["train"]["terms"]["alpha_c"], saved["train"]["optim"]["lr"]
    model2, cfg2 = settle(None, TrainConfig(), Start(9, saved=saved), CPU)
    assert (model2, cfg2) == (model, cfg)


def test_a_run_resumed_with_cuda_graphs_off_records_it(data_dir, tmp_path):
    """The resumed run's first log line and its checkpoints record the saved run's settings with this
    process's (that its steps are eager: tests/test_compiled.py)."""
    import json

    from captioner.models.checkpoint import load_checkpoint
    from captioner.train.trainer import FitJob, fit

    small, run = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12), tmp_path / "run"
    first = TrainConfig.of(epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, val_images=4)
    fit(FitJob(str(data_dir), str(run), small, first, device="cpu", progress_bar=False))
    again = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, val_images=4, cuda_graphs="off")
    fit(FitJob(str(data_dir), str(run), None, again, resume=True, device="cpu", progress_bar=False))
    starts = [x for x in map(json.loads, open(run / "metrics.jsonl", encoding="utf-8")) if x["event"] == "start"]
    recorded = [s["train"] for s in starts] + [load_checkpoint(str(run / "last.pt"))["train"]]
    assert [(t["process"]["cuda_graphs"], t["optim"]["lr"]) for t in recorded] == [
        ("auto", 3e-3),
        ("off", 3e-3),
        ("off", 3e-3),
    ]


def test_fit_help_is_grouped_by_concern():
    text = get_parser()._subparsers._group_actions[0].choices["fit"].format_help()
    for title in ("Optimisation", "How this process runs", "Schedule", "Attention terms", "Hard attention"):
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
    assert set(GROUPS) == {"optim", "process", "schedule", "terms", "hard", "scst"}


def test_without_views_the_consistency_is_settled_off_unless_a_fine_tuned_encoder_makes_them():
    plain = settle(None, TrainConfig(), Start(9, views=False), CPU)[1]
    tuned = settle(None, TrainConfig(fine_tune=FineTuneConfig()), Start(9, views=False), CPU)[1]
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
    files = {k: train[k] for k in ("init", "boxes") if k in train}  # fit's arguments, not settings
    train = {k: v for k, v in train.items() if k not in files}
    with pytest.raises(CaptionerError, match=refused):
        settle(model, TrainConfig.of(**train), Start(9, saved=saved, **files), CPU)


def test_a_refused_fit_leaves_no_trace(data_dir, tmp_path):
    """`fit` refuses before it writes: no run directory, no pool4 cache in the data directory."""
    from captioner.train.trainer import FitJob, fit

    before = sorted(p.name for p in data_dir.iterdir())
    cfg = TrainConfig.of(objective="scst", fine_tune=FineTuneConfig())
    with pytest.raises(CaptionerError, match="--init"):
        fit(FitJob(str(data_dir), str(tmp_path / "run"), None, cfg, device="cpu", progress_bar=False))
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
    cfg = TrainConfig.of(**given, fine_tune=FineTuneConfig(start="conv4_1", lr=0.5, after=1))
    args = ["fit", "--data", "d", "--out", "o", *command_line(cfg)]
    assert from_args(TrainConfig, get_parser().parse_args(args)) == cfg


def test_fit_help_says_each_derived_default_as_settle_settles_it():
    """A derived default is written once, in `settle.DERIVED`: every field settle derives has its rule
    there, and `fit --help` shows that rule, not a copy of it."""
    from captioner.train.resume import DERIVED

    assert set(DERIVED) == DERIVED_FIELDS
    text = " ".join(get_parser()._subparsers._group_actions[0].choices["fit"].format_help().split())
    text = re.sub(r"(?<=\w-) (?=\w)", "", text)  # argparse wraps lines after a hyphen
    for rule in DERIVED.values():
        assert f"(default: {' '.join(rule.split())})" in text, rule
