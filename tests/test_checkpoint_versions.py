"""Every earlier checkpoint layout loads, captions and resumes: one migration path (`models.checkpoint`).

The older layouts are written out from a current checkpoint as each version wrote them: version 1
(the first `fit`: a flat training config without the attention terms), 2 (the half-turn
equivariance term, fine-tuning without --tune-after), 3 (the consistency; still flat, with
`fused`; decoders before the word query and the decoding sharpness lacked those fields), 5 (grouped; the
--init and --boxes files among the settings, where 1 to 3 held them too; how its process ran it among the
other groups, as up to 6).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from captioner import Captioner
from captioner.models.checkpoint import PROCESS, TRAIN_GROUPS, VERSION, load_checkpoint, save_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit

V1_TRAIN = ("epochs", "batch_size", "lr", "grad_clip", "alpha_c", "max_minutes", "patience", "metric")
V1_TRAIN += ("val_beam_size", "val_images", "checkpoint_every", "log_every", "seed", "hard")
V1_PROGRESS = ("step", "epoch", "batch_in_epoch", "best", "best_step", "stale", "baseline")
V2_NEW_IN_3 = ("consistency", "consistency_share", "boxes", "boxes_weight", "boxes_choice_weight", "cooldown", "ema")


FILES = {"init": "first/best.pt", "boxes": "scenes/boxes.json"}  # what an older run read, among its settings


def _process_in_its_groups(train: dict) -> dict:
    """A version-7 training config as versions 4 to 6 grouped it: how its process ran it among the other groups."""
    train, process = {k: v for k, v in train.items() if k != "process"}, train["process"]
    for name, keys in PROCESS.items():
        if name == "checkpoints" or train.get(name) is not None:
            train[name] = {**train.get(name, {}), **{k: process[k] for k in keys if k in process}}
    return train


def older(ck: dict, version: int, *, early_decoder: bool = False, files: dict | None = None) -> dict:
    """A current checkpoint written out in an earlier version's layout (`files`: the --init and --boxes
    it read, its own by default)."""
    old = {k: v for k, v in ck.items() if k != "format"}
    files = files or {k: old["data"][k] for k in FILES}
    old["data"] = {k: v for k, v in old["data"].items() if k not in FILES}
    terms = {**old["train"]["terms"], "boxes": files["boxes"]}
    old["train"] = {**_process_in_its_groups(old["train"]), "init": files["init"], "terms": terms}
    if version == 5:
        return {**old, "format": "captioner-checkpoint/5"}
    train = {k: v for group in TRAIN_GROUPS for k, v in old["train"][group].items()}
    train |= {k: v for k, v in old["train"].items() if k not in TRAIN_GROUPS and k != "optim"}
    train["fused"] = old["train"]["optim"]["shapes"] != "fixed"
    old["train"] = train
    if version <= 2 or early_decoder:
        old["decoder"] = {k: v for k, v in old["decoder"].items() if k not in ("word_query", "decode_sharpness")}
    if version <= 2:
        train = {k: v for k, v in train.items() if k not in V2_NEW_IN_3}
        old["train"] = {**train, "equivariance": 1.0}
        old.pop("training_model", None)
    if version == 1:
        old["train"] = {k: v for k, v in train.items() if k in V1_TRAIN}
        old["progress"] = {k: v for k, v in old["progress"].items() if k in V1_PROGRESS}
        old = {k: v for k, v in old.items() if k not in ("familiarity", "attention", "command")}
    return {**old, "format": f"captioner-checkpoint/{version}"}


@pytest.mark.parametrize("version, early_decoder", [(1, True), (2, True), (3, True), (3, False), (5, False)])
def test_each_older_layout_loads_as_the_current_one(small_run, scenes, tmp_path, version, early_decoder):
    current = load_checkpoint(str(small_run / "last.pt"))
    current["decoder"]["decode_sharpness"] = 2.0
    path = tmp_path / "old.pt"
    torch.save(older(current, version, early_decoder=early_decoder, files=FILES), path)
    ck = load_checkpoint(str(path))
    assert ck["format"] == f"captioner-checkpoint/{VERSION}"
    decoder = DecoderConfig(**ck["decoder"])  # decoders from before these fields decode as trained, with h alone
    assert (decoder.word_query, decoder.decode_sharpness) == (False, 1.0 if early_decoder else 2.0)
    cfg = TrainConfig.from_dict(ck["train"])
    if version == 5:  # the files it read are kept beside its data, out of its settings
        assert cfg == TrainConfig.from_dict(current["train"])
    if version >= 3:
        assert ck["data"] == {**current["data"], **FILES}
    elif version < 3:  # trained without the consistency (and, before --ema, without the average)
        assert cfg.terms.consistency == 0.0 and cfg.optim.ema == 0.0 and "equivariance" not in str(ck["train"])
    else:  # `fused` said only which pass; the shapes are settled for the device the run resumes on
        assert cfg.process.shapes == "auto"
        assert replace(cfg, process=replace(cfg.process, shapes="packed")) == TrainConfig.from_dict(current["train"])
    image = sorted((scenes / "images").iterdir())[0]
    assert Captioner.load(str(path)).caption(image, beam_size=2).words


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 3])
def test_a_run_saved_by_an_older_version_resumes(small_run, data_dir, tmp_path, version):
    run = tmp_path / "run"
    run.mkdir()
    current = load_checkpoint(str(small_run / "last.pt"))
    save_checkpoint(older(current, version), str(run / "last.pt"))
    progress = fit(
        FitJob(
            str(data_dir),
            str(run),
            train=TrainConfig.of(epochs=current["progress"]["epoch"] + 1),
            resume=True,
            device="cpu",
            progress_bar=False,
        )
    )
    assert progress.step > current["step"]
    assert load_checkpoint(str(run / "last.pt"))["train"]["optim"]["lr"] == current["train"]["optim"]["lr"]


def test_a_newer_version_is_refused_by_name(small_run, tmp_path):
    from captioner.errors import CaptionerError

    ck = load_checkpoint(str(small_run / "last.pt"))
    torch.save({**ck, "format": f"captioner-checkpoint/{VERSION + 1}"}, tmp_path / "new.pt")
    with pytest.raises(CaptionerError, match="written by a newer captioner"):
        load_checkpoint(str(tmp_path / "new.pt"))
