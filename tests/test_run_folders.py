"""Run folders: created only when a run starts, claimed atomically, never by a refused ``fit``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lightning_dfl.cli import main
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.metrics.report import build_logger, claim_version_folder

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _fit(root: Path, *extra: str) -> list[str]:
    """A one-round digits fit with the CSV logger writing under ``root``."""
    return ["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--trainer.rounds=1", "--trainer.local_epochs=1",
            "--data.num_clients=4", "--trainer.algorithm.init_args.num_neighbors=2",
            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}", *extra]


def _run_folders(root: Path) -> list[Path]:
    return sorted(root.rglob("version_*")) if root.exists() else []


@pytest.fixture
def no_training(monkeypatch):
    def run_round(self, *args, **kwargs):
        raise AssertionError("a round started: the input was not refused before training")

    monkeypatch.setattr(FederatedTrainer, "run_round", run_round)


@pytest.mark.parametrize("extra", [
    ["--trainer.algorithm.init_args.num_neighbors=4"],  # refused by the algorithm's validation (set-up)
    ["--model.density=0"],  # refused by the module's constructor
    ["--data.partition=iid", "--data.num_clients=5000"],  # refused by the data's partition (set-up)
    ["--print_config"],
], ids=["validation", "constructor", "data", "print_config"])
def test_a_rejected_fit_leaves_no_run_folder(tmp_path, capsys, no_training, extra):
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path / "runs", *extra))
    assert info.value.code in (0, 2), capsys.readouterr().err
    assert _run_folders(tmp_path / "runs") == []


def test_a_refused_resume_leaves_no_run_folder(tmp_path, capsys, monkeypatch):
    main(_fit(tmp_path / "first", "--trainer.checkpoint_every=1", "--trainer.logger=false"))
    checkpoint = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    monkeypatch.setattr(FederatedTrainer, "run_round", lambda *a, **k: pytest.fail("the resume was not refused"))
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path / "runs", "--trainer.rounds=2", "--trainer.seed=7", f"--ckpt_path={checkpoint}"))
    assert info.value.code == 2 and "another configuration" in capsys.readouterr().err
    assert _run_folders(tmp_path / "runs") == []


def test_a_run_that_starts_gets_its_folder_with_its_config(tmp_path):
    main(_fit(tmp_path / "runs"))
    folders = _run_folders(tmp_path / "runs")
    assert [f.name for f in folders] == ["version_0"]
    assert {"config.yaml", "metrics.csv", "summary.json"} <= {p.name for p in folders[0].iterdir()}
    assert "class_path: lightning_dfl.federation.algorithms.DisPFL" in (folders[0] / "config.yaml").read_text()


def test_concurrent_claims_get_distinct_versions(tmp_path):
    (tmp_path / "version_3").mkdir()
    (tmp_path / "version_x").mkdir()
    barrier = threading.Barrier(16)
    claimed: list[int] = []

    def claim() -> None:
        barrier.wait()
        claimed.append(claim_version_folder(tmp_path))

    threads = [threading.Thread(target=claim) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == list(range(4, 20))
    assert all((tmp_path / f"version_{v}").is_dir() for v in claimed)


def test_a_folder_taken_after_the_listing_is_skipped(tmp_path, monkeypatch):
    """The race itself: another run creates version_0 between our listing and our mkdir."""
    import os

    real_mkdir = os.mkdir
    calls = []

    def racing_mkdir(path, *args, **kwargs):
        if not calls:
            real_mkdir(path, *args, **kwargs)  # the other run wins version_0
        calls.append(Path(path).name)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    assert claim_version_folder(tmp_path) == 1
    assert calls == ["version_0", "version_1"]


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_the_loggers_claim_their_folder_only_when_asked(tmp_path, kind):
    if kind == "tensorboard":
        pytest.importorskip("tensorboard")
    first, second = build_logger(kind, str(tmp_path), "algo"), build_logger(kind, str(tmp_path), "algo")
    assert not (tmp_path / "algo").exists()
    assert (first.version, second.version) == (0, 1)
    assert (tmp_path / "algo" / "version_0").is_dir() and (tmp_path / "algo" / "version_1").is_dir()


# -- one run per folder: a lock while it runs, and no writing over an earlier run ----------------------------------
HOLD = """
import sys, time
from lightning_dfl.federation.trainer.run_folder import RunFolderLock
lock = RunFolderLock()
lock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_folder_another_run_is_writing_is_refused_naming_that_process(tmp_path, capsys, no_training):
    import subprocess
    import sys

    root = tmp_path / "runs"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit) as info:
            main(_fit(root, "--trainer.logger=false", "--trainer.checkpoint_every=1"))
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert f"the run folder {root} is in use by another run (process {holder.pid} on " in err
        assert "one run writes a folder at a time" in err
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock died with it, and the next run takes the folder over
    import os

    from lightning_dfl.federation.trainer.run_folder import RunFolderLock, lock_path

    assert lock_path(root) == tmp_path / ".runs.lightning-dfl.lock" and lock_path(root).is_file()
    lock = RunFolderLock()
    lock.acquire(root)
    assert f"process {os.getpid()} on " in lock_path(root).read_text()
    lock.release()
    assert not lock_path(root).exists()


def test_a_folder_holding_a_run_is_not_written_over_unless_asked(tmp_path, capsys):
    root = tmp_path / "runs"
    version = ["--trainer.logger=CSVLogger", f"--trainer.logger.init_args.save_dir={root}",
               "--trainer.logger.init_args.name=dispfl", "--trainer.logger.init_args.version=version_7",
               "--trainer.checkpoint_every=1"]
    main(_fit(root, *version))
    folder = root / "dispfl" / "version_7"
    assert (folder / "checkpoints" / "last.ckpt").is_file() and (folder / "summary.json").is_file()
    first = (folder / "metrics.csv").read_text()
    with pytest.raises(SystemExit) as info:
        main(_fit(root, *version))
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"the run folder {folder} already holds a run (metrics.csv, clients.csv, summary.json" in err
    assert f"resume it with --ckpt_path {folder / 'checkpoints' / 'last.ckpt'}" in err
    assert (folder / "metrics.csv").read_text() == first  # untouched
    # resuming from its own checkpoint writes on; overwrite removes the earlier files first (its checkpoint too)
    main(_fit(root, *version, "--trainer.rounds=2", f"--ckpt_path={folder / 'checkpoints' / 'last.ckpt'}"))
    main(_fit(root, *version[:4], "--trainer.overwrite=true",
              "--trainer.seed=3"))
    assert not (folder / "checkpoints" / "last.ckpt").exists()
    assert "seed: 3" in (folder / "config.yaml").read_text() and (folder / "summary.json").is_file()
    assert sorted(p.name for p in (root / "dispfl").iterdir()) == ["version_7"]  # no lock file left
