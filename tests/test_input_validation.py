"""What a run writes stays valid whatever its numbers: ``summary.json`` is strict JSON."""

from __future__ import annotations

import json
import math

import numpy as np

from lightning_dfl.federation.metrics.report import RunSummary


def _strict_json(text: str):
    """``json.loads`` that refuses the non-standard tokens NaN, Infinity and -Infinity."""
    def refuse(token):
        raise AssertionError(f"summary.json holds the invalid JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_a_summary_without_accuracy_writes_null_not_nan(tmp_path):
    # eval_every beyond the rounds run (or a run stopped before its first evaluation): no acc/headline at all
    history = [{"density/mean": 0.5, "flops/train_per_client": 1e6, "flops/train_total": 6e6}]
    summary = RunSummary.from_history("dispfl", history, wall_time_s=1.5, log_dir=str(tmp_path))
    assert math.isnan(summary.final_accuracy) and math.isnan(summary.best_accuracy)
    data = _strict_json(summary.save(tmp_path).read_text())
    assert data["final_accuracy"] is None and data["best_accuracy"] is None
    assert data["final_density"] == 0.5 and data["flops_total"] == 6e6 and data["rounds"] == 1
    assert data["algorithm"] == "dispfl" and data["log_dir"] == str(tmp_path)


def test_every_non_finite_value_becomes_null():
    summary = RunSummary(algorithm="fedavg", rounds=3, final_accuracy=float("inf"), best_accuracy=np.float32("nan"),
                         final_density=np.float64(0.25), flops_per_client_round=-float("inf"), flops_total=0.0,
                         busiest_mb_per_round=1.0, busiest_mask_mb_per_round=0.0, mean_delay=float("nan"),
                         wall_time_s=2.0)
    data = _strict_json(summary.to_json())
    assert [data[k] for k in ("final_accuracy", "best_accuracy", "flops_per_client_round", "mean_delay")] == [None] * 4
    assert data["final_density"] == 0.25 and data["log_dir"] is None and data["rounds"] == 3
    assert math.isinf(summary.final_accuracy)  # the record itself keeps its numbers; only the JSON says null


# -- issue 37: bad input refused in one line, or given a documented meaning ---------------------------------------
import pytest  # noqa: E402


def test_a_seed_must_be_an_integer_numpy_accepts():
    from lightning_dfl.federation import FederatedTrainer

    for bad in (1.5, -1, 2**32):
        with pytest.raises(ValueError, match=rf"seed must be an integer in \[0, 4294967295\], got {bad!r}"):
            FederatedTrainer(seed=bad, logger=False)


def test_cpu_threads_are_bounded_by_the_cpus_the_process_may_use():
    """More intra-op threads than the process's CPUs only wait for each other; 100000 crashed OpenMP's runtime."""
    import os

    from lightning_dfl.federation import FederatedTrainer

    usable = len(os.sched_getaffinity(0))
    assert FederatedTrainer(cpu_threads=usable, logger=False).settings.cpu_threads == usable
    for bad in (0, usable + 1, 100_000):
        with pytest.raises(ValueError, match=rf"cpu_threads \(at most the {usable} CPUs this process may use\) must "
                                             rf"be an integer in \[1, {usable}\], got {bad}"):
            FederatedTrainer(cpu_threads=bad, logger=False)


def test_a_second_fit_on_one_trainer_is_refused(tmp_path):
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import Local
    from lightning_dfl.module import SparseClassifier

    trainer = FederatedTrainer(algorithm=Local(), rounds=1, local_steps=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, default_root_dir=str(tmp_path), diagnostics=False)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05)
    data = FederatedDataModule(dataset="digits", num_clients=2, batch_size=16, test_samples_per_client=10)
    trainer.fit(model, data)
    with pytest.raises(ValueError, match="already ran fit once; a trainer runs one fit"):
        trainer.fit(model, data)
    assert len(trainer.history) == 1


@pytest.mark.parametrize("args", [["--neighbors=[0]"], ["--neighbors=[100]"]], ids=["M_0", "M_K"])
def test_schedule_refuses_neighbor_counts_outside_1_to_k_minus_1(capsys, args):
    from lightning_dfl.cli import main

    with pytest.raises(SystemExit) as info:
        main(["schedule", "--num_clients=100", "--rounds=10", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "neighbors (M) for 100 clients must be an integer in [1, 99]" in err


def test_plot_and_export_refuse_an_out_path_under_a_file(tmp_path, capsys):
    from lightning_dfl.cli import main

    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "run").mkdir()
    for args in (["plot", "diagnostics", str(tmp_path / "run"), "--out", str(afile / "figs")],
                 ["export", str(afile), f"--out={afile / 'c.pt2'}"]):
        with pytest.raises(SystemExit) as info:
            main(args)
        err = capsys.readouterr().err
        assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "which is a file, not a folder" in err and str(afile) in err


def test_export_refuses_a_checkpoint_whose_client_model_holds_nan(tmp_path):
    import torch

    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.export import export_client
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import PRISAM
    from lightning_dfl.federation.trainer.checkpoint_file import read_state, write_state
    from lightning_dfl.module import SparseClassifier

    trainer = FederatedTrainer(algorithm=PRISAM(ratio=0.5, num_groups=2, warmup_rounds=1), rounds=1, local_steps=1,
                               logger=False, accelerator="cpu", enable_progress_bar=False, checkpoint_every=1,
                               default_root_dir=str(tmp_path), diagnostics=False)
    trainer.fit(SparseClassifier(arch="resnet20", density=1.0, lr=0.05),
                FederatedDataModule(dataset="digits", num_clients=4, batch_size=16, test_samples_per_client=10))
    state = read_state(trainer.checkpoint_path)
    name = next(n for n, t in state["store"]["weights"].items() if t.is_floating_point())
    state["store"]["weights"][name][:, 1] = float("nan")
    write_state(trainer.checkpoint_path, state)
    with pytest.raises(ValueError, match=rf"client 1's model .* holds a non-finite value .* parameter {name!r}"):
        export_client(trainer.checkpoint_path, 1, tmp_path / "c.pt2", latency=False, test_images=False)
    assert not (tmp_path / "c.pt2").exists()
    assert torch.isfinite(state["store"]["weights"][name][:, 0]).all()


def test_one_class_per_client_warns_that_its_test_set_is_smaller():
    from lightning_dfl.datamodules import FederatedDataModule

    dm = FederatedDataModule(dataset="digits", num_clients=100, partition="pathological", classes_per_client=1,
                             test_samples_per_client=45)
    with pytest.warns(UserWarning, match="a client of one class gets fewer test samples"):
        dm.setup()
