"""`train.py coco ROOT`: the COCO recipe against a small COCO-shaped mirror served on 127.0.0.1.

The mirror holds generated scenes in COCO's own layout: `zips/train2014.zip` and `zips/val2014.zip`
(train2014/COCO_train2014_<id>.jpg ...), `annotations/annotations_trainval2014.zip`
(annotations/captions_{train,val}2014.json), `caption_datasets.zip` (dataset_coco.json) and a
SHA256SUMS; its server answers Range requests and can be told to drop connections, go slowly,
serve damaged bytes or answer an error.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections import namedtuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_cli
from PIL import Image

import captioner.data.archives as archives
import captioner.data.download as download
import captioner.data.fetch as fetch
from captioner.cli import coco, coco_stages
from captioner.errors import CaptionerError
from captioner.scenes.synthetic import generate

FILES = ("zips/train2014.zip", "zips/val2014.zip", "annotations/annotations_trainval2014.zip", "caption_datasets.zip")
# A fit of a few seconds with a small decoder: enough for a model that writes words.
QUICK = [
    "--encoder-weights",
    "none",
    "--prepare-args=--min-word-freq 1 --workers 0",
    "--fit-args=--epochs 1 --max-minutes 0.1 --batch-size 16 --embed-dim 32 --hidden-dim 32 --attention-dim 16 "
    "--val-beam-size 1 --checkpoint-minutes 0",
]


# the mirror


def _zip(members: dict[str, bytes], method=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def coco_files(scenes: Path) -> dict[str, bytes]:
    """COCO 2014's four files, made of generated scenes: train images in train2014, the rest in val2014."""
    caps = json.loads((scenes / "captions.json").read_text())
    karpathy = json.loads((scenes / "splits.json").read_text())
    where = {}
    for img in karpathy["images"]:
        sub = "train2014" if img["split"] == "train" else "val2014"
        where[img["cocoid"]] = sub, f"COCO_{sub}_{img['cocoid']:012d}.jpg"
        img["filepath"], img["filename"] = where[img["cocoid"]]
    images, annotations = {"train2014": {}, "val2014": {}}, {}
    for img in caps["images"]:
        sub, name = where[img["id"]]
        jpg = io.BytesIO()
        Image.open(scenes / "images" / img["file_name"]).convert("RGB").save(jpg, "JPEG", quality=90)
        images[sub][f"{sub}/{name}"] = jpg.getvalue()
    for sub in images:
        ids = {i for i, (s, _) in where.items() if s == sub}
        annotations[f"annotations/captions_{sub}.json"] = json.dumps(
            {
                **caps,
                "images": [{**i, "file_name": where[i["id"]][1]} for i in caps["images"] if i["id"] in ids],
                "annotations": [a for a in caps["annotations"] if a["image_id"] in ids],
            }
        ).encode()
    return {
        "zips/train2014.zip": _zip(images["train2014"], zipfile.ZIP_STORED),
        "zips/val2014.zip": _zip(images["val2014"], zipfile.ZIP_STORED),
        "annotations/annotations_trainval2014.zip": _zip(annotations),
        "caption_datasets.zip": _zip({"dataset_coco.json": json.dumps(karpathy).encode()}),
    }


class Handler(BaseHTTPRequestHandler):
    """GET and HEAD of the mirror's files, with `bytes=N-` ranges and the server's faults."""

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path, server = self.path.lstrip("/"), self.server
        fault = server.faults.get(path, {})
        entry = {"method": self.command, "path": path, "range": self.headers.get("Range"), "sent": 0}
        server.requests.append(entry)
        data = fault.get("data", server.files.get(path))
        if "status" in fault or data is None:
            self.send_error(fault.get("status", 404))
            return
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        start = int(m[1]) if m else 0
        if start >= len(data) > 0:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.end_headers()
            return
        self.send_response(206 if m else 200)
        if m:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if body:
            self._send(data[start:], fault, entry)

    def _send(self, rest: bytes, fault: dict, entry: dict) -> None:
        limit = fault.get("drop") if fault.get("times", 1) > 0 else None
        if limit is not None:
            fault["times"] = fault.get("times", 1) - 1
            rest = rest[:limit]  # then the connection closes, short of Content-Length
        step = fault.get("step", 1 << 16)
        try:
            for i in range(0, len(rest), step):
                self.wfile.write(rest[i : i + step])
                self.wfile.flush()
                entry["sent"] += len(rest[i : i + step])
                time.sleep(fault.get("delay", 0))
        except OSError:  # the client went away
            pass


class Mirror(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files: dict[str, bytes]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files, self.faults, self.requests = files, {}, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def gets(self, path: str | None = None) -> list[dict]:
        return [r for r in self.requests if r["method"] == "GET" and path in (None, r["path"])]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    """The four files and their SHA256SUMS."""
    scenes = tmp_path_factory.mktemp("scenes")
    generate(str(scenes), 28, seed=7)
    out = coco_files(scenes)
    out["SHA256SUMS"] = "".join(f"{hashlib.sha256(out[f]).hexdigest()}  {f}\n" for f in FILES).encode()
    return out


@pytest.fixture
def mirror(files):
    server = Mirror(dict(files))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(download, "RETRY_WAIT", 0.0)


def recipe(capsys, *argv) -> tuple[int, str, str]:
    """The recipe run in this process, as `train.py coco` runs it: (exit status, stdout, stderr)."""
    status = coco.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


def fetched(root: Path) -> None:
    assert len(os.listdir(root / "train2014")) + len(os.listdir(root / "val2014")) == 28
    assert (root / "annotations" / "captions_val2014.json").is_file()
    assert (root / "caption_datasets" / "dataset_coco.json").is_file()


# tests


def test_fetch_checks_and_unpacks_then_a_second_run_does_nothing(tmp_path, mirror, capsys):
    status, out, err = recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")
    assert status == 0, err
    fetched(tmp_path)
    assert not os.listdir(tmp_path / "downloads")  # the zips were removed once unpacked
    assert "checked (sha256)" in err and "needs" in err and "free" in err
    record = json.loads((tmp_path / "recipe.json").read_text())
    assert record["stages"]["fetch"]["outputs"]["splits"] == str(tmp_path / "caption_datasets" / "dataset_coco.json")

    before = len(mirror.requests)
    status, out, err = recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")
    assert status == 0 and "nothing to do" in out
    assert len(mirror.requests) == before


def test_files_the_user_has_are_not_fetched(tmp_path, mirror, capsys):
    theirs = tmp_path / "theirs"
    assert recipe(capsys, theirs, "--mirror", mirror.url, "--stage", "fetch")[0] == 0
    mirror.requests.clear()
    images = [theirs / "train2014", theirs / "val2014"]
    captions = [theirs / "annotations" / f"captions_{s}2014.json" for s in ("train", "val")]
    status, _, err = recipe(
        capsys,
        tmp_path / "root",
        "--mirror",
        mirror.url,
        "--stage",
        "fetch",
        "--images",
        *images,
        "--captions",
        *captions,
    )
    assert status == 0, err
    assert {r["path"] for r in mirror.gets()} == {"SHA256SUMS", "caption_datasets.zip"}


@pytest.mark.slow
def test_a_killed_download_goes_on_from_where_it_stopped(tmp_path, mirror, capsys):
    name, size = "zips/train2014.zip", len(mirror.files["zips/train2014.zip"])
    mirror.faults[name] = {"step": 4096, "delay": 0.05}  # about 80 kB/s: time to kill it
    part = tmp_path / "downloads" / "train2014.zip.part"
    p = subprocess.Popen(
        [sys.executable, "-m", "captioner.cli.coco", tmp_path, "--mirror", mirror.url, "--stage", "fetch"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (part.exists() and part.stat().st_size > size // 3) and time.monotonic() < deadline:
        assert p.poll() is None, "the fetch ended before it could be killed"
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    kept = part.stat().st_size
    assert 0 < kept < size
    mirror.faults.clear()
    mirror.requests.clear()

    status, _, err = recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")
    assert status == 0, err
    fetched(tmp_path)
    (again,) = mirror.gets(name)
    assert again["range"] == f"bytes={kept}-"
    assert again["sent"] == size - kept  # no byte fetched twice


def test_a_connection_that_keeps_dropping_completes_through_ranges(tmp_path, mirror, capsys, quick_retries):
    name = "zips/val2014.zip"
    mirror.faults[name] = {"drop": 8_000, "times": 1000}
    status, _, err = recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")
    assert status == 0, err
    fetched(tmp_path)
    gets = mirror.gets(name)
    assert len(gets) > 2 and all(g["range"] for g in gets[1:])
    assert sum(g["sent"] for g in gets) == len(mirror.files[name])


def test_a_damaged_zip_is_refused_by_name_before_unpacking(tmp_path, mirror, capsys):
    data = bytearray(mirror.files["zips/val2014.zip"])
    data[len(data) // 2] ^= 0xFF
    mirror.faults["zips/val2014.zip"] = {"data": bytes(data)}
    status, _, err = recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")
    assert status == 2
    assert re.search(r"error: val2014\.zip from http://127\.0\.0\.1:\d+/zips/val2014\.zip is damaged", err), err
    assert "sha256" in err
    assert not (tmp_path / "val2014").exists() and not (tmp_path / ".val2014.unpacking").exists()
    assert not (tmp_path / "downloads" / "val2014.zip").exists()
    assert not (tmp_path / "recipe.json").exists()


def test_without_sha256sums_the_official_sizes_apply(tmp_path, mirror, capsys, monkeypatch):
    mirror.faults["SHA256SUMS"] = {"status": 404}
    # The official files need 34 GB: the disk check must pass whatever this machine has free.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**14, 0, 10**14))
    status, _, err = recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")
    assert status == 2
    assert "annotations_trainval2014.zip" in err and "252,872,794" in err and "not the expected file" in err


@pytest.mark.parametrize(
    "fault, said",
    [
        ({"status": 404}, "answered 404 Not Found"),
        ({"status": 500}, "answered 500 Internal Server Error (tried 4 times in a row)"),
        ({"drop": 0, "times": 1000}, "closed after 0 of"),
        (None, "cannot connect to"),
    ],
    ids=["404", "500", "dropped", "refused"],
)
def test_server_and_network_failures_name_the_file_and_the_url(tmp_path, mirror, capsys, quick_retries, fault, said):
    url = mirror.url
    if fault is None:  # nothing listens there any more
        mirror.shutdown()
        mirror.server_close()
    else:
        mirror.faults["caption_datasets.zip"] = fault
    status, _, err = recipe(capsys, tmp_path, "--mirror", url, "--stage", "fetch")
    assert status == 2
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert said in line
    target = "SHA256SUMS" if fault is None else "caption_datasets.zip"
    assert f"{target}: " in line and f"{url}/{target}" in line


def test_a_full_disk_is_found_before_the_stage_that_would_fill_it(tmp_path, mirror, capsys, monkeypatch, data_dir):
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 500, 500))
    status, out, err = recipe(capsys, tmp_path, "--mirror", mirror.url)
    assert status == 2
    assert re.search(
        r"error: fetching annotations_trainval2014\.zip, .* needs [\d.]+ kB, but the device .* has 500 bytes free", err
    )
    assert not mirror.gets("zips/train2014.zip") and not os.listdir(tmp_path / "downloads")

    monkeypatch.setattr(shutil, "disk_usage", real)
    assert recipe(capsys, tmp_path, "--mirror", mirror.url, "--stage", "fetch")[0] == 0
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 500, 500))
    status, out, err = recipe(capsys, tmp_path, "--stage", "prepare", "--encoder-weights", "none")
    assert status == 2
    # What prepare writes per image, read from a data directory it made of the same kind of scenes:
    # the image's features and its view's.
    per_image = sum(np.load(data_dir / f, mmap_mode="r")[0].nbytes for f in ("features.npy", "features_views.npy"))
    images = len(os.listdir(tmp_path / "train2014")) + len(os.listdir(tmp_path / "val2014"))
    need = re.escape(archives.size_text(images * per_image))
    assert re.search(rf"error: prepare's features of {images} images \(x2 with their views\) needs {need}", err), err
    assert "$ " not in out and not (tmp_path / "data").exists()  # refused before prepare started


def test_a_stage_without_its_inputs_says_which_stage_to_run(tmp_path, capsys):
    status, _, err = recipe(capsys, tmp_path, "--stage", "fit")
    assert status == 2 and "run the prepare stage first" in err


def test_unpack_refuses_members_outside_the_folder(tmp_path):
    archive = tmp_path / "evil.zip"
    archive.write_bytes(_zip({"train2014/a.jpg": b"x", "../outside.txt": b"y"}))
    with pytest.raises(CaptionerError, match=r"evil\.zip: refused: member '\.\./outside\.txt'"):
        archives.unpack(str(archive), str(tmp_path / "root"), "train2014", name="evil.zip", progress=False)
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "root" / "train2014").exists()


def test_unpack_names_the_zip_and_the_member_whose_crc_is_wrong(tmp_path):
    good = _zip({"val2014/a.jpg": b"first image " * 20, "val2014/b.jpg": b"second image " * 20}, zipfile.ZIP_STORED)
    at = good.index(b"second image ")  # b.jpg's stored bytes: change one, and its CRC-32 no longer matches
    archive = tmp_path / "val2014.zip"
    archive.write_bytes(good[:at] + b"S" + good[at + 1 :])
    with pytest.raises(CaptionerError, match=r"^val2014\.zip: val2014/b\.jpg is damaged \(Bad CRC-32"):
        archives.unpack(str(archive), str(tmp_path / "root"), "val2014", name="val2014.zip", progress=False)
    assert not (tmp_path / "root" / "val2014").exists()  # nothing half unpacked in place


@pytest.mark.parametrize("kind", ["not a zip", "cut short", "missing"])
def test_unpack_says_which_zip_it_cannot_read(tmp_path, kind):
    archive = tmp_path / "train2014.zip"
    whole = _zip({"train2014/a.jpg": b"x" * 500})
    if kind == "not a zip":
        archive.write_bytes(b"<html>a login page, not the archive</html>")
    elif kind == "cut short":
        archive.write_bytes(whole[: len(whole) // 2])  # the central directory at its end is gone
    with pytest.raises(CaptionerError, match=r"^train2014\.zip: not a readable zip \("):
        archives.unpack(str(archive), str(tmp_path / "root"), "train2014", name="train2014.zip", progress=False)
    assert not (tmp_path / "root" / "train2014").exists()


def test_a_killed_unpack_is_done_again(tmp_path):
    root = tmp_path / "root"
    (root / ".val2014.unpacking" / "val2014").mkdir(parents=True)
    (root / ".val2014.unpacking" / "val2014" / "half.jpg").write_bytes(b"half")
    archive = tmp_path / "val2014.zip"
    archive.write_bytes(_zip({"val2014/a.jpg": b"a", "val2014/b.jpg": b"b"}))
    archives.unpack(str(archive), str(root), "val2014", name="val2014.zip", progress=False)
    assert sorted(os.listdir(root / "val2014")) == ["a.jpg", "b.jpg"] and os.listdir(root) == ["val2014"]


def test_a_rerun_redoes_a_stage_whose_products_are_gone_only_for_a_stage_that_reads_them(tmp_path):
    made = {s: tmp_path / s for s in coco.STAGES}
    for path in made.values():
        path.mkdir()
    stages = {s: {"finished": "then", "outputs": {"out": str(made[s])}} for s in coco.STAGES}
    assert coco.to_run({}, None) == list(coco.STAGES)
    assert coco.to_run(stages, None) == [] and coco.to_run(stages, "fit") == []
    made["fetch"].rmdir()  # the images, removed once prepared
    assert coco.to_run(stages, None) == []
    made["export"].rmdir()
    assert coco.to_run(stages, None) == ["export"]
    made["evaluate"].rmdir()
    made["prepare"].rmdir()
    assert coco.to_run(stages, None) == ["fetch", "prepare", "evaluate", "export"]
    assert coco.to_run(stages, "prepare") == ["prepare"]
    made["fit"].rmdir()  # a new fit: new scores and a new export
    assert coco.to_run(stages, None) == ["fetch", "prepare", "fit", "evaluate", "export"]
    for path in made.values():
        path.mkdir(exist_ok=True)
    stages["fit"]["finished"] = "zzz"  # a fit run alone (--stage fit) after the export
    assert coco.to_run(stages, None) == ["evaluate", "export"]


def test_several_gpus_run_prepare_and_fit_under_torchrun():
    cmd = coco_stages.train_command("fit", ["--data", "D"], gpus=4)
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m"]
    assert cmd[7:] == ["captioner.cli.train", "fit", "--data", "D"]
    assert coco_stages.train_command("evaluate", ["--data", "D"], gpus=4)[-3:] == ["evaluate", "--data", "D"]
    assert "torch.distributed.run" not in coco_stages.train_command("fit", [], gpus=1)


def test_evaluate_says_plainly_when_java_is_missing(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "not the official ones" in coco_stages.java_warning()
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/java")
    assert coco_stages.java_warning() is None


def test_space_for_coco_counts_each_zip_beside_its_contents():
    sizes = [(r.size, 0) for r in fetch.COCO_2014 if r.size]
    total = sum(s for s, _ in sizes)
    assert archives.space_needed(sizes, keep=False) == total + fetch.COCO_2014[-1].size  # the largest zip last
    assert archives.space_needed(sizes, keep=True) == 2 * total


def test_the_training_command_line_has_the_coco_command(capsys):
    from captioner.cli import train

    with pytest.raises(SystemExit) as e:
        train.main(["coco", "--help"])
    assert e.value.code == 0 and "--mirror" in capsys.readouterr().out


@pytest.mark.slow
def test_train_py_has_the_coco_command():
    p = run_cli("train.py", "coco", "--help")
    assert p.returncode == 0 and "--mirror" in p.stdout, p.stderr


@pytest.mark.slow
def test_the_whole_recipe_from_an_empty_folder_to_a_model_that_captions(tmp_path, mirror):
    root = tmp_path / "coco"
    p = run_cli("-m", "captioner.cli.coco", str(root), "--mirror", mirror.url, *QUICK, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    stages = json.loads((root / "recipe.json").read_text())["stages"]
    assert list(stages) == ["fetch", "prepare", "fit", "evaluate", "export"]
    for sub in ("prepare", "fit", "evaluate"):
        assert re.search(rf"^\$ .* {sub} ", p.stdout, flags=re.M), p.stdout
    assert f"hf upload ORG/NAME {root / 'model'} ." in p.stdout
    metrics = json.loads((root / "run" / "test_metrics.json").read_text())
    assert {"BLEU-4", "CIDEr"} <= set(metrics) and stages["evaluate"]["official"] == metrics["official"]

    image = next((root / "val2014").iterdir())
    p = run_cli("-m", "captioner", "caption", "--checkpoint", str(root / "model"), str(image))
    assert p.returncode == 0, p.stderr[-3000:]
    path, caption = p.stdout.strip().split("\t")
    assert path == str(image) and caption.split()

    mirror.requests.clear()
    p = run_cli("-m", "captioner.cli.coco", str(root), "--mirror", mirror.url, *QUICK)
    assert p.returncode == 0 and "nothing to do: every stage had finished" in p.stdout
    assert "$ " not in p.stdout and not mirror.requests
