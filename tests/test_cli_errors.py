"""Bad input through the real entry point ends with one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_dfl.cli import entry, main
from lightning_dfl.errors import ConfigurationError
from lightning_dfl.federation import FederatedTrainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DADPFL = "--trainer.algorithm=lightning_dfl.federation.algorithms.DADPFL"
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
                 "batches.meta")


def _jpeg(path: Path, value: int = 128) -> None:
    from torchvision.io import encode_jpeg, write_file

    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(str(path), encode_jpeg(torch.full((3, 8, 8), value, dtype=torch.uint8)))


def _image_folder(root: Path, train=("ant", "bee"), test=("ant", "bee")) -> Path:
    for half, classes in (("train", train), ("test", test)):
        for c, name in enumerate(classes):
            for i in range(2):
                _jpeg(root / half / name / f"{i}.jpg", 40 * c + i)
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Tiny bad inputs on disk: data folders, config files and checkpoints."""
    from lightning_dfl.federation.trainer.checkpoint_file import write_state

    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "empty").mkdir()
    for name in CIFAR10_FILES:  # the right names one level too high: not torchvision's layout
        (tmp / "cifar_flat" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "cifar_flat" / name).write_bytes(b"\x80\x04N.")
        (tmp / "cifar_fake" / "cifar-10-batches-py" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "cifar_fake" / "cifar-10-batches-py" / name).write_bytes(b"not the official pickle")
    (tmp / "train_only" / "train" / "ant").mkdir(parents=True)
    _jpeg(tmp / "train_only" / "train" / "ant" / "0.jpg")
    _image_folder(tmp / "test_class", test=("ant", "bee", "cat"))
    _image_folder(tmp / "corrupt_image")
    (tmp / "corrupt_image" / "train" / "bee" / "1.jpg").write_bytes(b"not a jpeg")
    _image_folder(tmp / "fifo_image")
    (tmp / "fifo_image" / "train" / "bee" / "1.jpg").unlink()
    os.mkfifo(tmp / "fifo_image" / "train" / "bee" / "1.jpg")  # reading it would block
    os.mkfifo(tmp / "fifo.yaml")
    os.mkfifo(tmp / "fifo_ckpt.ckpt")
    (tmp / "syntax.yaml").write_text("trainer:\n  rounds: [1\nmodel:\n  lr: 0.1\n")
    (tmp / "type.yaml").write_text("trainer:\n  rounds: ten\n")
    (tmp / "unknown_key.yaml").write_text("trainer:\n  roundz: 3\n")
    laughs = ['lol0: &lol0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    laughs += [f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]" for i in range(1, 10)]
    (tmp / "laughs.yaml").write_text("\n".join(laughs) + "\nmodel:\n  model_options:\n    hidden: *lol9\n")
    (tmp / "duplicate.yaml").write_text("trainer:\n  rounds: 1\nmodel:\n  lr: 0.1\ntrainer:\n  seed: 3\n")
    (tmp / "nested_duplicate.yaml").write_text("trainer:\n  rounds: 1\n  seed: 2\n  rounds: 3\n")
    good = write_state(tmp / "good.ckpt", {"weights": torch.zeros(1000)})
    (tmp / "truncated.ckpt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp / "zero.ckpt").write_bytes(b"")
    (tmp / "random.ckpt").write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                                    dtype=torch.uint8).numpy().tobytes())
    torch.save({"a": 1}, tmp / "foreign.ckpt")
    torch.save({"format": "lightning-dfl/federation", "format_version": 99, "next_round": 1}, tmp / "v99.ckpt")
    return {p.name.split(".")[0]: p for p in tmp.iterdir()}  # e.g. "syntax" for syntax.yaml


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Every bad input must be refused before the first round."""

    def run_round(self, *args, **kwargs):
        raise AssertionError("a round started: the bad input was not refused before training")

    monkeypatch.setattr(FederatedTrainer, "run_round", run_round)


def _fit(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--trainer.rounds=1", "--trainer.local_epochs=1",
            "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path / 'runs'}", *extra]


NEEDS_VALIDATION = pytest.mark.xfail(strict=True, reason="validation by the datamodule/module helper")

# (id, extra fit arguments ({name} is a path from the `files` fixture), what the message must name)
CASES = [
    # config values
    ("num_clients_0", ["--data.num_clients=0"], ["num_clients", "0"]),
    ("num_neighbors_ge_K", ["--trainer.algorithm.init_args.num_neighbors=50"], ["M=50", "K=20"]),
    ("max_wait_gt_M", [DADPFL, "--trainer.algorithm.init_args.max_wait=8"], ["max_wait", "8"]),
    ("density_0", ["--model.density=0"], ["density", "0"]),
    ("density_1.5", ["--model.density=1.5"], ["density", "1.5"]),
    ("alpha_negative", ["--data.alpha=-1"], ["alpha", "-1"]),
    ("lr_0", ["--model.lr=0"], ["lr", "0"]),
    ("local_epochs_negative", ["--trainer.local_epochs=-1"], ["local_epochs", "-1"]),
    ("batch_size_0", ["--data.batch_size=0"], ["batch_size", "0"]),
    ("rounds_0", ["--trainer.rounds=0"], ["rounds", "0"]),
    ("target_sparsity_1.2", [DADPFL, "--trainer.algorithm.init_args.target_sparsity=1.2"], ["target_sparsity", "1.2"]),
    ("delta_pr_0", [DADPFL, "--trainer.algorithm.init_args.delta_pr=0"], ["delta_pr", "0"]),
    ("delta_v_2", [DADPFL, "--trainer.algorithm.init_args.delta_v=2"], ["delta_v", "2"]),
    ("b_negative", [DADPFL, "--trainer.algorithm.init_args.b=-1"], ["b", "-1"]),
    ("c_0", [DADPFL, "--trainer.algorithm.init_args.c=0"], ["c", "0"]),
    ("drop_fraction_1.5", ["--trainer.algorithm.init_args.drop_fraction=1.5"], ["drop_fraction", "1.5"]),
    ("num_classes_0", ["--model.num_classes=0"], ["num_classes", "0"]),
    ("num_classes_not_the_data's", ["--model.num_classes=5"], ["num_classes", "5", "10"]),
    ("test_samples_per_client_0", ["--data.test_samples_per_client=0"], ["test_samples_per_client", "0"]),
    ("rounds_not_an_int", ["--trainer.rounds=ten"], ["trainer.rounds", "ten"]),
    ("num_neighbors_not_an_int", ["--trainer.algorithm.init_args.num_neighbors=four"], ["num_neighbors", "four"]),
    ("client_speeds_wrong_length", ["--trainer.client_speeds=[1,2]"], ["client_speeds", "2", "20"]),
    ("devices_0", ["--trainer.devices=0"], ["devices", "0"]),
    ("strategy_fsdp_with_2_devices", ["--trainer.devices=2", "--trainer.strategy=fsdp"], ["fsdp", "'ddp'"]),
    # a callback whose default is no plain value (Timer's interval=Interval.step) cannot be saved: not a syntax error
    ("callback_default_not_yaml", ["--trainer.callbacks+=Timer"], ["config.yaml", "Interval.step", "plain value"]),
    ("num_nodes_without_machines", ["--trainer.num_nodes=2"], ["num_nodes=2", "NODE_RANK", "MASTER_ADDR",
                                                                "Several machines", "num_nodes=1"]),
    # a hook given as a callable that cannot take the hook's arguments: refused before training (was a crash in it)
    ("lambda_callback_wrong_arity", ["--trainer.callbacks+=LambdaCallback",
                                     "--trainer.callbacks.init_args.on_fit_start=uuid.uuid4"],
     ["LambdaCallback", "on_fit_start=uuid4", "(trainer, pl_module)"]),
    ("callback_not_shardable", ["--trainer.devices=2", "--trainer.callbacks+=DeviceStatsMonitor"],
     ["DeviceStatsMonitor", "on_train_batch_end", "sharding protocol", "devices=1"]),
    ("accelerator_absent", ["--trainer.accelerator=mps"], ["MPS"]),
    ("accelerator_tpu", ["--trainer.accelerator=tpu"], ["accelerator='tpu'", "auto, cpu, gpu, cuda, mps"]),
    ("seed_negative", ["--trainer.seed=-1"], ["seed", "-1", "[0, 4294967295]"]),
    ("cpu_threads_beyond_the_cpus", ["--trainer.cpu_threads=100000"], ["cpu_threads", "100000", "CPUs this process"]),
    # unknown names
    ("unknown_dataset", ["--data.dataset=imagenet42"], ["imagenet42", "digits", "cifar10"]),
    ("unknown_arch", ["--model.arch=resnet1000"], ["resnet1000", "cnn_digits"]),
    ("unknown_partition", ["--data.partition=zipf"], ["zipf", "dirichlet", "pathological"]),
    ("unknown_topology", ["--trainer.algorithm.init_args.topology=star"], ["star", "ring", "trainer.algorithm"]),
    ("unknown_algorithm_path", ["--trainer.algorithm.class_path=lightning_dfl.federation.algorithms.FedProx"],
     ["FedProx", "DisPFL"]),
    ("unknown_algorithm_name", ["--trainer.algorithm=FedProx"], ["FedProx", "DADPFL"]),
    # a drop_fraction callable that returns no fraction: refused before training (it failed in round 1, "a bug")
    ("rigl_drop_fraction_callable_returns_none", ["--trainer.callbacks+=lightning_dfl.callbacks.RigL",
                                                  "--trainer.callbacks.init_args.drop_fraction=builtins.print"],
     ["drop_fraction", "print returned None", "t=0", "[0, 1]"]),
    # two stateful callbacks of one class would share one checkpoint entry (the second silently overwrote it)
    ("two_rigl_callbacks", ["--trainer.callbacks+=lightning_dfl.callbacks.RigL",
                            "--trainer.callbacks+=lightning_dfl.callbacks.RigL"],
     ["two RigL callbacks", "checkpoint entry", "'RigL'", "give one RigL"]),
    # the base class plans nothing: refused before training (it ran into NotImplementedError, "a bug")
    ("abstract_algorithm", ["--trainer.algorithm=lightning_dfl.federation.algorithms.base.Algorithm"],
     ["algorithm Algorithm", "base class", "cannot plan a round", "dispfl", "plan_round"]),
    ("algorithm_class_path_null", ["--trainer.algorithm.class_path=null"],
     ["trainer.algorithm", "class_path is null", "DisPFL"]),
    ("unknown_algorithm_option", ["--trainer.algorithm.init_args.num_neighbours=3"], ["num_neighbours", "topology"]),
    ("unknown_regrowth", ["--trainer.algorithm.init_args.regrowth=magic"], ["magic", "gradient", "random"]),
    ("unknown_distribution", ["--model.distribution=gaussian"], ["gaussian", "erk"]),
    ("unknown_clock_distribution", ["--trainer.clock=Clock", "--trainer.clock.init_args.distribution=zipf"],
     ["zipf", "exponential"]),
    ("unknown_store_device", ["--trainer.store_device=gpu"], ["gpu", "worker"]),
    ("unknown_model_option", ['--model.model_options={{"depth": 3}}'], ["depth", "hidden"]),
    ("unknown_logger", ["--trainer.logger=wandb2"], ["wandb2", "tensorboard"]),
    ("unknown_callback", ["--trainer.callbacks+=NoSuchCallback"], ["NoSuchCallback", "RigL"]),
    ("unknown_option", ["--data.batchsize=3"], ["--data.batchsize", "--data.batch_size"]),
    # partitions
    ("partition_leaves_a_client_empty", ["--data.alpha=0.001", "--data.min_size=0"], ["no training samples"]),
    ("more_clients_than_samples", ["--data.partition=iid", "--data.num_clients=5000"], ["5000"]),
    ("more_classes_per_client_than_exist", ["--data.partition=pathological", "--data.classes_per_client=11"],
     ["classes_per_client", "11", "10"]),
    # data paths
    ("cifar10_root_missing", ["--data.dataset=cifar10", "--data.root={empty}/absent"],
     ["absent", "cifar-10-batches-py"]),
    ("cifar10_root_empty", ["--data.dataset=cifar10", "--data.root={empty}"], ["{empty}", "data_batch_1"]),
    ("cifar10_wrong_layout", ["--data.dataset=cifar10", "--data.root={cifar_flat}"], ["{cifar_flat}", "layout"]),
    ("cifar10_not_official", ["--data.dataset=cifar10", "--data.root={cifar_fake}"], ["{cifar_fake}", "corrupt"]),
    ("image_folder_empty", ["--data.dataset=image_folder", "--data.root={empty}"], ["{empty}", "train"]),
    ("image_folder_no_test", ["--data.dataset=image_folder", "--data.root={train_only}"], ["{train_only}", "test"]),
    ("image_folder_class_only_in_test", ["--data.dataset=image_folder", "--data.root={test_class}"], ["cat"]),
    ("image_folder_corrupt_image", ["--data.dataset=image_folder", "--data.root={corrupt_image}"], ["1.jpg"]),
    # YAML
    ("yaml_syntax_error", ["--config={syntax}"], ["{syntax}", "line 3"]),
    ("yaml_type_error", ["--config={type}"], ["{type}", "rounds", "ten"]),
    ("yaml_unknown_key", ["--config={unknown_key}"], ["roundz", "did you mean trainer.rounds?"]),
    ("config_file_missing", ["--config={empty}/absent.yaml"], ["absent.yaml"]),
    ("yaml_billion_laughs", ["--config={laughs}"], ["{laughs}", "aliases", "100000"]),
    ("yaml_duplicate_section", ["--config={duplicate}"], ["{duplicate}", "'trainer' twice", "lines 1 and 5"]),
    ("yaml_duplicate_key", ["--config={nested_duplicate}"], ["{nested_duplicate}", "'rounds' twice", "lines 2 and 4"]),
    # checkpoints
    # what would block or never end: refused by what it is, before it is opened
    ("config_fifo", ["--config={fifo}"], ["{fifo}", "a FIFO (named pipe), not a regular file"]),
    ("config_device", ["--config=/dev/zero"], ["/dev/zero", "a character device, not a regular file"]),
    ("ckpt_fifo", ["--ckpt_path={fifo_ckpt}"], ["{fifo_ckpt}", "a FIFO (named pipe), not a regular file"]),
    ("image_folder_fifo_image", ["--data.dataset=image_folder", "--data.root={fifo_image}"],
     ["1.jpg", "a FIFO (named pipe), not a regular file"]),
    ("ckpt_truncated", ["--ckpt_path={truncated}"], ["{truncated}", "truncated"]),
    ("ckpt_empty", ["--ckpt_path={zero}"], ["{zero}", "empty"]),
    ("ckpt_random_bytes", ["--ckpt_path={random}"], ["{random}", "not a checkpoint"]),
    ("ckpt_foreign", ["--ckpt_path={foreign}"], ["{foreign}", "not a lightning-dfl"]),
    ("ckpt_missing", ["--ckpt_path={empty}/absent.ckpt"], ["absent.ckpt"]),
    # values that passed their own check but cannot work together with the model, the data or the memory
    ("lr_beyond_float32", ["--model.lr=1e308"], ["model.lr=1e+308", "float32", "3.40282e+38"]),
    ("image_size_beyond_memory", ["--model.arch=resnet18", "--data.image_size=20000"],
     ["image_size=20000", "501.80 GiB", "at most"]),
    ("image_size_beyond_the_model", ["--data.image_size=20000"], ["image_size=20000", "parameters", "at most"]),
    ("density_leaves_a_layer_empty", ["--model.density=1e-9"], ["density=1e-09", "'features.0.weight'"]),
    ("mask_exclude_matches_nothing", ["--model.mask_exclude=[nonexistent_layer]"],
     ["nonexistent_layer", "features.0.weight", "classifier.2.weight"]),
    ("seed_everything_not_the_run_seed", ["--seed_everything=5"], ["seed_everything=5", "--trainer.seed"]),
    ("local_steps_and_local_epochs", ["--trainer.local_steps=5", "--trainer.local_epochs=2"],
     ["local_steps=5", "local_epochs=2", "None"]),
    ("prisam_num_groups_beyond_clients", ["--trainer.algorithm=PRISAM", "--trainer.algorithm.init_args.num_groups=50"],
     ["num_groups=50", "20 clients"]),
    ("resume_allow_without_ckpt_path", ["--trainer.resume_allow=[model/lr]"], ["resume_allow", "--ckpt_path"]),
    ("root_with_the_embedded_digits", ["--data.root={empty}"], ["{empty}", "'digits'", "data.root"]),
    # paths the run could not create, values that would train nothing or overflow (issue 37)
    ("root_dir_too_long", ["--trainer.default_root_dir=/tmp/" + "a" * 5000], ["default_root_dir", "at most 4096 bytes"]),
    ("root_dir_name_too_long", ["--trainer.default_root_dir=/tmp/" + "a" * 300 + "/runs"],
     ["default_root_dir", "at most 255 bytes"]),
    ("root_dir_empty", ["--trainer.default_root_dir="], ["default_root_dir must be a folder path, got ''"]),
    ("root_dir_under_a_file", ["--trainer.default_root_dir={good}/runs"], ["default_root_dir", "which is a file"]),
    ("cache_is_a_file", ["--data.cache={good}"], ["cache", "{good}", "is a file"]),
    ("model_option_not_an_int", ['--model.model_options={{"hidden": 1.5}}'], ["hidden", "must be an integer", "1.5"]),
    ("model_option_too_large", ['--model.model_options={{"hidden": 10000000}}'], ["hidden", "parameters", "at most"]),
    ("lr_subnormal", ["--model.lr=1e-320"], ["model.lr=9.99989e-321", "smallest normal", "float32", "round to 0"]),
    ("num_neighbors_0", ["--trainer.algorithm.init_args.num_neighbors=0"], ["num_neighbors must be >= 1", "Local"]),
    ("beer_ratio_0", ["--trainer.algorithm=BEER", "--trainer.algorithm.init_args.topology=ring",
                      "--trainer.algorithm.init_args.ratio=0"], ["ratio must be a number in (0, 1]", "got 0"]),
    ("client_speed_huge", ["--trainer.client_speeds=[1e300" + ",1" * 19 + "]"], ["1e+300", "[1e-06, 1e+06]"]),
    ("client_speed_tiny", ["--trainer.client_speeds=[1e-300" + ",1" * 19 + "]"], ["1e-300", "[1e-06, 1e+06]"]),
    ("image_size_odd", ["--data.image_size=3"], ["cnn_digits needs an even image_size", "got 3"]),
    ("ckpt_format_version_99", ["--ckpt_path={v99}"], ["{v99}", "format_version 99", "newer"]),
    # stock Lightning callbacks that need a Trainer's loops
    ("callback_model_checkpoint", ["--trainer.callbacks+=ModelCheckpoint"], ["ModelCheckpoint", "checkpoint_every"]),
    ("callback_early_stopping", ["--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=acc/headline"],
     ["EarlyStopping", "trainer.rounds"]),
    ("callback_lr_monitor", ["--trainer.callbacks+=LearningRateMonitor"], ["LearningRateMonitor", "lr_decay"]),
]


#: cases that cannot fail on every machine
MARKS = {"accelerator_absent": pytest.mark.skipif(sys.platform == "darwin", reason="MPS may exist on macOS")}


@pytest.mark.parametrize(("extra", "named"), [pytest.param(e, n, id=i, marks=MARKS.get(i, ())) for i, e, n in CASES])
def test_bad_input_is_one_line(tmp_path, files, capsys, extra, named):
    extra = [arg.format(**files) for arg in extra]
    with pytest.raises(SystemExit) as exit_info:
        main(_fit(tmp_path, *extra))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3, err
    assert lines[-1].startswith("lightning-dfl: error: ") and lines[-1].endswith("(run with --debug for the traceback)")
    for word in named:
        assert word.format(**files) in err, f"{word!r} not named in: {err}"


def test_a_dense_store_too_large_for_the_memory_is_one_line(tmp_path, monkeypatch, capsys):
    import lightning_dfl.federation.store.memory as store_memory

    monkeypatch.setattr(store_memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(SystemExit) as exit_info:
        main(_fit(tmp_path))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "only 1.0 MiB of memory are available: set trainer.store: compact" in err


def test_at_least_30_bad_inputs():
    assert len(CASES) >= 30


def test_debug_flag_and_environment_variable_raise_the_original_error(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="num_clients"):
        main(_fit(tmp_path, "--data.num_clients=0", "--debug"))
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        main(["--debug", *_fit(tmp_path, "--trainer.algorithm.init_args.topology=star")])
    monkeypatch.setenv("LIGHTNING_DFL_DEBUG", "1")
    with pytest.raises(ValueError, match="density"):
        main(_fit(tmp_path, "--model.density=0"))
    assert "lightning-dfl: error" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["algorithm_init", "fit"])
def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys, where):
    """Not every exception is bad input: one raised by a bug (here a ZeroDivisionError) propagates as it is,
    also when jsonargparse wraps it while instantiating a class from the config."""
    import functools

    from lightning_dfl.federation.algorithms import DisPFL

    owner, name = (DisPFL, "__init__") if where == "algorithm_init" else (FederatedTrainer, "fit")

    @functools.wraps(getattr(owner, name))  # the same signature: jsonargparse accepts the config's options
    def broken(self, *args, **kwargs):
        return 1 / 0

    monkeypatch.setattr(owner, name, broken)
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path))
    err = capsys.readouterr().err
    assert info.value.code == 1, err
    assert "Traceback" in err and "ZeroDivisionError" in err and "lightning-dfl: error" not in err
    assert err.strip().splitlines()[-1].startswith("lightning-dfl: internal error: this is a bug in lightning-dfl")


@pytest.mark.parametrize(("error", "code"), [
    (TypeError("unsupported operand type(s) for +: 'int' and 'str'"), 1),  # a bug, raised by a raise statement
    (ConfigurationError("num_things must be an integer >= 1, got 0"), 2),  # the project's typed bad input
], ids=["TypeError", "ConfigurationError"])
def test_bad_input_is_told_apart_by_type_not_by_where_it_was_raised(tmp_path, monkeypatch, capsys, error, code):
    """A ``TypeError`` raised by the project's own code is a bug unless it is a ``ConfigurationError`` (what the
    argument checks raise); both raised the same way, in a class's ``__init__`` that jsonargparse wraps."""
    import functools

    from lightning_dfl.federation.algorithms import DisPFL

    @functools.wraps(DisPFL.__init__)
    def refuse(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(DisPFL, "__init__", refuse)
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path))
    err = capsys.readouterr().err
    assert info.value.code == code, err
    if code == 2:
        assert err.strip().splitlines() == [
            f"lightning-dfl: error: trainer.algorithm: {error} (run with --debug for the traceback)"]
    else:
        assert "Traceback" in err and "lightning-dfl: internal error: this is a bug" in err


def test_the_argument_checks_raise_the_typed_error():
    from lightning_dfl.checks import check_int, check_output_path, check_positive
    from lightning_dfl.cli.errors import is_user_error
    from lightning_dfl.models import build_model

    for check in (lambda: check_int("rounds", 0, 1), lambda: check_positive("lr", -1.0),
                  lambda: check_output_path("out", ""), lambda: build_model("cnn_digits", 10, depth=3)):
        with pytest.raises(ConfigurationError) as info:
            check()
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError) and is_user_error(info.value)
    assert not is_user_error(TypeError("a bug"))


def test_a_real_console_shows_the_line_and_nothing_else(tmp_path):
    """No warning or log line around the message (in-process tests cannot see import-time output), and no run
    folder in the current directory."""
    result = subprocess.run([sys.executable, "-m", "lightning_dfl", "fit", "--config",
                             str(CONFIGS / "dispfl_digits.yaml"), "--trainer.algorithm.init_args.num_neighbors=50"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert list(tmp_path.iterdir()) == []
    assert result.stderr.splitlines() == [
        "lightning-dfl: error: num_neighbors (M) must be < the number of clients (K): got M=50, K=20 "
        "(run with --debug for the traceback)"]


def test_version(capsys):
    from importlib.metadata import version as installed

    from lightning_dfl.cli.help import version

    main(["--version"])
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first == f"lightning-dfl {version()}" and version()[:1].isdigit()
    # the stack a bug report needs, read without importing it (it answers where torch fails to import)
    for package in ("torch", "torchvision", "lightning", "jsonargparse"):
        assert f"{package} {installed(package)}" in second, second
    assert f"python {sys.version.split()[0]}" in second


@pytest.mark.parametrize("first", ["train", "fti", "--config", "--hepl"])
def test_unknown_subcommand_lists_all_of_them(capsys, first):
    with pytest.raises(SystemExit) as exit_info:
        main([first, "configs/dispfl_digits.yaml"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.startswith("lightning-dfl: error: ") and first in err.splitlines()[0]
    for command in ("fit", "schedule", "cost", "curves"):
        assert any(line.strip().startswith(command + " ") for line in err.splitlines()[1:]), err
    if first == "fti":
        assert "did you mean 'fit'?" in err
    if first == "--hepl":  # a mistyped option, not a misplaced one
        assert "unknown option '--hepl' (did you mean '--help'?)" in err
    if first == "--config":
        assert "the subcommand comes first" in err


@pytest.mark.parametrize(("args", "named"), [
    (["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--trainer.round=10"], "(did you mean --trainer.rounds?)"),
    (["fit", "--config", str(CONFIGS / "dispfl_digits.yaml"), "--model.dens=0.3"], "(did you mean --model.density?)"),
    (["cost", "--run", "runs/x"], "(did you mean --runs?)"),
    (["plot", "diagnostics", "runs/x", "--ou", "figs"], "--ou"),
])
def test_a_prefix_of_an_option_is_not_taken_for_it(capsys, args, named):
    """argparse took --trainer.round=10 for --trainer.rounds (and --model.dens for --model.density) silently."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unrecognized arguments" in err and named in err, err


def test_fit_help_is_plain_text_with_allowed_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for markup in (":data:`", ":class:`", ":func:`", ":mod:`", ":attr:`", "``"):
        assert markup not in out, markup
    for name in ("digits", "cifar10", "tiny_imagenet", "image_folder",  # data sets
                 "cnn_digits", "resnet18",  # models
                 "dirichlet_equal", "pathological",  # partitions
                 "DADPFL", "DisPFL", "FedAvg", "tensorboard"):  # algorithms, loggers
        assert name in out, name


@pytest.mark.parametrize(("option", "names"), [
    ("--trainer.algorithm.help=DisPFL", ["time_varying_in_degree", "gradient", "random"]),
    ("--trainer.algorithm.help=DADPFL", ["time_varying_in_degree", "gradient", "random"]),
    ("--trainer.clock.help=Clock", ["exponential", "discrete"]),
    ("--trainer.callbacks.help=RigL", ["gradient", "epoch", "uniform"]),
])
def test_class_help_is_plain_text_with_allowed_values(capsys, option, names):
    with pytest.raises(SystemExit):
        main(["fit", option])
    out = capsys.readouterr().out
    assert ":data:`" not in out and ":class:`" not in out and "``" not in out
    assert all(name in out for name in names), out


def test_analysis_subcommand_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cost", f"--runs=[{tmp_path / 'absent'}]"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "no metrics.csv" in err and "absent" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["schedule", "--num_clients=many"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "num_clients" in err and "many" in err and len(err.splitlines()) == 1


class _Interrupted(KeyboardInterrupt):
    """What the trainer raises on SIGTERM (duck-typed: exit_code, resume_hint)."""

    def __init__(self) -> None:
        super().__init__("stopped after round 3; checkpoint runs/x/checkpoints/last.ckpt")
        self.exit_code = 143
        self.resume_hint = "lightning-dfl fit --config c.yaml --ckpt_path runs/x/checkpoints/last.ckpt"


def test_interrupt_prints_the_resume_hint_and_exits_with_its_code(tmp_path, monkeypatch, capsys):
    def fit(self, *args, **kwargs):
        raise _Interrupted()

    monkeypatch.setattr(FederatedTrainer, "fit", fit)
    with pytest.raises(SystemExit) as exit_info:
        main(_fit(tmp_path))
    err = capsys.readouterr().err
    assert exit_info.value.code == 143 and "Traceback" not in err
    assert "resume with: lightning-dfl fit --config c.yaml --ckpt_path runs/x/checkpoints/last.ckpt" in err
    assert len(err.strip().splitlines()) <= 2

    def plain_fit(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(FederatedTrainer, "fit", plain_fit)
    with pytest.raises(SystemExit) as exit_info:
        main(_fit(tmp_path))
    assert exit_info.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_the_cli_gives_the_trainer_its_command_line(tmp_path, monkeypatch):
    seen = {}

    def fit(self, *args, **kwargs):
        seen["command_line"] = getattr(self, "command_line", None)

    monkeypatch.setattr(FederatedTrainer, "fit", fit)
    monkeypatch.setattr("lightning_dfl.cli.fit.FederatedCLI.after_fit", lambda self: None)
    args = _fit(tmp_path, "--trainer.seed=3")
    main([*args, "--debug"])
    assert seen["command_line"] == ["lightning-dfl", *args]


def test_a_bad_checkpoint_leaves_no_run_folder(tmp_path, files, capsys):
    args = [a for a in _fit(tmp_path, f"--ckpt_path={files['random']}") if a != "--trainer.logger=false"]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2 and "not a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("config.yaml"))


def test_a_checkpoint_holding_nan_is_refused_in_one_line_before_training(tmp_path, capsys, monkeypatch):
    from lightning_dfl.federation.trainer.checkpoint_file import read_state, write_state

    blocked = FederatedTrainer.run_round
    monkeypatch.undo()  # the run that writes the checkpoint trains one round
    main(_fit(tmp_path, "--trainer.checkpoint_every=1"))
    monkeypatch.setattr(FederatedTrainer, "run_round", blocked)  # the resume must not
    ckpt = tmp_path / "runs" / "checkpoints" / "last.ckpt"
    state = read_state(ckpt)
    name = sorted(state["store"]["weights"])[0]
    state["store"]["weights"][name][:, 3] = float("nan")
    write_state(ckpt, state)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, "--trainer.rounds=2", f"--ckpt_path={ckpt}"))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "non-finite" in err and "client 3" in err and repr(name) in err
    assert read_state(ckpt)["next_round"] == 1  # no round ran: the file is as it was


def _garbage_rigl(state):
    state["callbacks"]["RigL"] = {key: "garbage" for key in state["callbacks"]["RigL"]}


def _nan_clock(state):
    state["clock"]["elapsed"] = float("nan")


@pytest.mark.parametrize(("damage", "named"), [(_garbage_rigl, ["the callbacks' state 'RigL'", "'garbage'"]),
                                               (_nan_clock, ["the clock's state", "elapsed", "nan"])],
                         ids=["garbage_rigl_state", "nan_clock"])
def test_a_checkpoint_whose_part_cannot_be_loaded_names_the_file_and_the_part(tmp_path, capsys, monkeypatch, damage,
                                                                             named):
    from lightning_dfl.federation.trainer.checkpoint_file import read_state, write_state

    blocked = FederatedTrainer.run_round
    monkeypatch.undo()  # the run that writes the checkpoint trains one round
    main(_fit(tmp_path, "--trainer.checkpoint_every=1", "--data.num_clients=6",
              "--trainer.algorithm.init_args.num_neighbors=2"))
    monkeypatch.setattr(FederatedTrainer, "run_round", blocked)  # the resume must not
    ckpt = tmp_path / "runs" / "checkpoints" / "last.ckpt"
    state = read_state(ckpt)
    damage(state)
    write_state(ckpt, state)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, "--trainer.rounds=2", f"--ckpt_path={ckpt}", "--data.num_clients=6",
                  "--trainer.algorithm.init_args.num_neighbors=2"))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"the checkpoint {str(ckpt)!r}" in err and all(word in err for word in named), err


@pytest.mark.parametrize("error", [ValueError("setting an array element with a sequence"), KeyError("w"),
                                   FileNotFoundError("x.npy")], ids=["ValueError", "KeyError", "FileNotFoundError"])
def test_an_error_raised_inside_a_round_is_a_bug_not_bad_input(tmp_path, monkeypatch, capsys, error):
    """Only validation (before the first round) reports bad input; whatever a round raises is a bug."""

    def run_round(self, round_idx):
        raise error

    monkeypatch.setattr(FederatedTrainer, "run_round", run_round)
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path))
    err = capsys.readouterr().err
    assert info.value.code == 1, err
    assert "Traceback" in err and type(error).__name__ in err and "lightning-dfl: error" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lightning-dfl: internal error (raised in round 1, metrics.csv's round 0): this is a bug")
    assert "report" in last


def test_every_client_diverging_is_one_line_naming_round_clients_and_cause(tmp_path, monkeypatch, capsys):
    monkeypatch.undo()  # it trains a round
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, "--model.lr=1e30"))
    err = capsys.readouterr().err
    assert info.value.code == 3, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("lightning-dfl: error: the run diverged: round 1 of")
    assert "every client that trained (20: [0, 1, 2" in err
    assert "learning rate is probably too high" in err
    assert "No checkpoint was written (checkpoint_every=0)" in err and "finite weights only" not in err


def test_a_run_that_diverges_after_some_rounds_writes_their_summary_and_says_where(tmp_path):
    """A run that trained a while before every client diverged (configs/beer_digits_same_batch.yaml, in round 322
    or 380 by the CPU) still reports those rounds: summary.json, with ``stopped``, then exit 3 naming the file."""
    (tmp_path / "poison.py").write_text(
        "import torch\n"
        "from lightning_dfl.callbacks.base import FederatedCallback\n\n\n"
        "class Poison(FederatedCallback):\n"
        "    def on_client_train_end(self, trainer, pl_module, client_id):\n"
        "        if trainer.current_round >= 1:  # every client's update turns NaN from round 2 on\n"
        "            with torch.no_grad():\n"
        "                for p in pl_module.parameters():\n"
        "                    p.fill_(float('nan'))\n")
    root = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / "dispfl_digits.yaml"),
                           "--trainer.rounds=3", "--trainer.local_epochs=1", "--trainer.enable_progress_bar=false",
                           "--data.num_clients=4", "--trainer.algorithm.init_args.num_neighbors=2",
                           "--trainer.callbacks+=poison.Poison", f"--trainer.default_root_dir={root}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 3, done.stderr[-2000:]
    (summary_file,) = root.glob("*/version_*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["rounds"] == 1 and summary["stopped"] == "diverged in round 2 of 3"
    assert summary["final_accuracy"] > 0.1  # round 1's results, as a finished run reports them
    assert f"(checkpoint_every=0). {summary_file} summarizes round 1." in " ".join(done.stderr.split())


def test_a_diverged_run_names_the_checkpoint_it_leaves_or_says_there_is_none(tmp_path):
    from lightning_dfl.federation.trainer.checkpoint import checkpoint_left

    assert checkpoint_left(None, 0) == "No checkpoint was written (checkpoint_every=0)"
    assert checkpoint_left(None, 5) == "No checkpoint was written yet (checkpoint_every=5: the first after round 5)"
    assert checkpoint_left((tmp_path / "checkpoints" / "last.ckpt", 5), 5) == (
        f"The last checkpoint, {tmp_path / 'checkpoints' / 'last.ckpt'} (after round 5), holds finite weights only")


# -- the run folder cannot be written, a run's file cannot be read ---------------------------------------------
def _full_disk(monkeypatch, name: str, code: int = errno.ENOSPC) -> None:
    """Writing a file called ``name`` (or making a folder of that name) fails as on a full (or read-only) disk."""
    real_open, real_mkdir = builtins.open, os.mkdir

    def fail(path):
        raise OSError(code, os.strerror(code), str(path))

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name == name and any(m in mode for m in "wax+"):
            fail(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if Path(path).name == name:
            fail(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


@pytest.mark.parametrize(("name", "code"), [
    ("metrics.csv", errno.ENOSPC), ("clients.csv", errno.ENOSPC), ("summary.json", errno.ENOSPC),
    ("edges.csv", errno.ENOSPC), ("bytes.csv", errno.ENOSPC), ("config.yaml", errno.ENOSPC),
    ("version_0", errno.EROFS),  # a read-only run folder: its version_N cannot be made
])
def test_a_run_file_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, name, code):
    """A full disk or a read-only folder while writing metrics.csv, clients.csv, summary.json or the diagnostics
    (inside a round too) is one line naming the file and the OS's cause, exit 2, not an internal error."""
    monkeypatch.undo()  # the run trains: the failure comes from the file
    _full_disk(monkeypatch, name, code)
    args = [a for a in _fit(tmp_path, "--data.num_clients=6", "--trainer.algorithm.init_args.num_neighbors=2")
            if a != "--trainer.logger=false"]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"cannot write '{tmp_path / 'runs'}" in err and name in err, err
    assert errno.errorcode[code] in err, err


_COLUMNS = b"round,acc/headline,flops/train_per_client,comm/busiest_bytes,time/delay\n"


@pytest.mark.parametrize("content", [_COLUMNS + b"\xff\xfe0,1,1,1,1\n", _COLUMNS + b"0,zero,1,1,soon\n"],
                         ids=["not_utf8", "not_a_number"])
def test_an_unreadable_metrics_csv_is_named(tmp_path, capsys, content):
    (tmp_path / "metrics.csv").write_bytes(content)
    for command in (["cost", f"--runs=[{tmp_path}]"], ["curves", f"--runs=[{tmp_path}]", "--metrics=[acc/headline]"]):
        with pytest.raises(SystemExit) as info:
            main(command)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"cannot read '{tmp_path / 'metrics.csv'}'" in err, err


def test_a_refusal_is_printed_by_rank_0_only(tmp_path, monkeypatch, capsys):
    """With --trainer.devices 2 every process refuses a bad checkpoint: the line was printed twice. On several
    machines each machine's launching process prints it (its terminal would show nothing else)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a process its machine's launcher started
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, "--data.num_clients=0"))
    assert info.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.delenv("LOCAL_RANK")  # the second machine's launching process (rank 1 of num_nodes=2, devices=1)
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, "--data.num_clients=0"))
    assert info.value.code == 2 and "num_clients" in capsys.readouterr().err
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, "--data.num_clients=0"))
    assert info.value.code == 2 and "num_clients" in capsys.readouterr().err


def test_a_warning_is_one_line_without_a_source_path(tmp_path, capsys, monkeypatch):
    """A run's warnings (here: every client misses the deadline) are printed as ``lightning-dfl: warning: ...``,
    one line each, not as ``.../report.py:124: UserWarning: ...`` with the source line under it."""
    monkeypatch.undo()  # it trains a round
    main(_fit(tmp_path, "--trainer.deadline=0.5"))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        "lightning-dfl: warning: round 1: 20 client(s) missed the deadline; no client was evaluated: the round has "
        "no acc/personal_mean (said once per run)",
        "lightning-dfl: warning: the run has no accuracy (final_accuracy is null in summary.json): no client met "
        "the deadline (0.5) in an evaluated round"], err
    assert warnings.showwarning is not entry.show_warning  # Python's own is back after the command


def test_a_class_from_a_module_in_the_working_folder_that_python_cannot_import_says_how(tmp_path, monkeypatch,
                                                                                         capsys):
    package = tmp_path / "myalgo"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")  # must not be imported for the hint
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(SystemExit) as exit_info:
        main(_fit(tmp_path, "--trainer.algorithm=myalgo.ringmix.RingMix"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "unknown class 'myalgo.ringmix.RingMix'" in err
    assert f"the module 'myalgo' is in the working folder {tmp_path} but not on Python's path: run with " \
           "PYTHONPATH=." in err


@pytest.mark.parametrize("module_text, value, reason", [
    (None, "{pkg}.missing.Foo", "(no module '{pkg}.missing' on Python's path: is it installed, or is its folder in "
                                "PYTHONPATH?)"),
    ("import not_installed_dependency_xyz\n", "{pkg}.mod.RingMix",
     "(importing '{pkg}.mod' failed: No module named 'not_installed_dependency_xyz')"),
    ("class RingMix:\n    pass\n\n\nclass Other:\n    pass\n", "{pkg}.mod.Ringmix",
     "(the module '{pkg}.mod' has no 'Ringmix'; its classes: Other, RingMix)"),
], ids=["no_module", "import_fails", "no_such_class"])
def test_a_user_class_that_cannot_be_imported_says_why(tmp_path, monkeypatch, capsys, module_text, value, reason):
    """An import path on Python's path that names no class: the line says which of the three it is, from the
    import's own error (the module is not imported a second time for the message)."""
    pkg = f"userpkg_{len(module_text or '')}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    if module_text is not None:
        (tmp_path / pkg / "mod.py").write_text(module_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(_fit(tmp_path, f"--trainer.algorithm={value.format(pkg=pkg)}"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert f"unknown class '{value.format(pkg=pkg)}'" in err and reason.format(pkg=pkg) in err, err
    for name in [n for n in sys.modules if n.startswith(pkg)]:
        monkeypatch.delitem(sys.modules, name)


BOMB = "\n".join([f'a: &a [{",".join(["x"] * 9)}]'] + [f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]"
                                                        for p, n in zip("abcdefgh", "bcdefghi")])


@pytest.mark.parametrize("where", ["inline_config", "class_option_file"])
def test_an_alias_bomb_anywhere_the_cli_reads_yaml_is_one_line(tmp_path, capsys, where):
    """A 'billion laughs' (9^9 values from 400 bytes) as an inline --config string or in a class option's file
    grew to gigabytes; every YAML text the CLI loads is checked first."""
    if where == "inline_config":
        args = _fit(tmp_path, "--config", BOMB)
        named = "the inline --config expands to more than 100000 values"
    else:
        (tmp_path / "algorithm.yaml").write_text(BOMB)
        args = _fit(tmp_path, f"--trainer.algorithm={tmp_path / 'algorithm.yaml'}")
        named = "a YAML value (an inline --config, or a file given to an option) expands to more than 100000"
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert named in err and "billion laughs" in err, err


def test_a_fifo_given_to_a_class_option_is_refused_by_what_it_is(tmp_path, capsys):
    fifo = tmp_path / "algorithm.yaml"
    os.mkfifo(fifo)
    for form in ([f"--trainer.algorithm={fifo}"], ["--trainer.algorithm", str(fifo)]):
        with pytest.raises(SystemExit) as info:
            main(_fit(tmp_path, *form))
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert f"the file given to --trainer.algorithm '{fifo}' is a FIFO (named pipe), not a regular file" in err


def test_an_inline_config_longer_than_a_file_name_is_read_as_yaml(tmp_path, capsys):
    """Over 255 bytes an inline config is no possible file name: the check of whether it is a file crashed."""
    inline = ('{"trainer": {"rounds": 1, "eval_every": 1, "enable_progress_bar": false}, "data": {"num_clients": 4, '
              '"batch_size": 32, "test_samples_per_client": 10}, "model": {"arch": "cnn_digits", "density": 0.5, '
              '"distribution": "erk", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}, "seed_everything": 0}')
    assert len(inline) > 255
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", inline, "--print_config"])
    assert info.value.code == 0
    assert "test_samples_per_client: 10" in capsys.readouterr().out


def test_a_torchvision_built_for_another_torch_is_one_line_with_the_fix(tmp_path, monkeypatch, capsys):
    """Seen where a CPU torch came from pip's find-links with the registry's torchvision: the import failed with
    'operator torchvision::nms does not exist', reported as an internal error."""
    import builtins
    from importlib import metadata

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path))
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (f"torchvision {metadata.version('torchvision')} cannot load against the installed torch "
            f"{metadata.version('torch')} (operator torchvision::nms does not exist)") in err
    assert "pip install --force-reinstall torch torchvision" in err


@pytest.mark.parametrize("command", ["curves", "schedule"])
def test_a_plot_path_under_a_file_is_one_line_before_any_work(tmp_path, capsys, command):
    pytest.importorskip("matplotlib")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("round,acc/headline\n0,0.5\n")
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "figure.png"
    args = ([command, f"--runs=[{tmp_path / 'run'}]", "--metrics=[acc/headline]"] if command == "curves"
            else [command]) + [f"--plot={out}"]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"plot path '{out}' lies under '{tmp_path / 'afile'}', which is a file, not a folder" in err


@pytest.mark.parametrize("form", [["--trainer.algorithm.class_path=this.DisPFL"], ["--trainer.algorithm", "this.DisPFL"],
                                  ["--trainer.callbacks+=this.RigL"], ["--config", "trainer:\n  algorithm:\n    "
                                                                                  "class_path: this.DisPFL\n"]])
def test_a_project_class_name_from_another_module_is_refused_before_that_module_runs(tmp_path, capsys, form):
    """``this.DisPFL`` imported ``this`` (printing the Zen of Python: its top-level code ran) before the class was
    refused."""
    with pytest.raises(SystemExit) as info:
        main(_fit(tmp_path, *form))
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert "Beautiful is better than ugly" not in out
    name = "RigL" if "RigL" in form[0] else "DisPFL"
    assert f"'this.{name}' names the class {name} from the module 'this'" in err
    assert "before that module is imported" in err
