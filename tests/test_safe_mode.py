"""What a config may import and call (lightning_dfl.cli.trust): jsonargparse's denylist always, safe mode's
allowlist with ``--safe``, modules trusted by name with ``--trust``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dfl.cli import main
from lightning_dfl.cli.trust import Policy, strip_flags
from lightning_dfl.errors import ConfigurationError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _fit(tmp_path: Path, *extra: str, config: str = "dispfl_digits.yaml") -> list[str]:
    return ["fit", "--config", str(CONFIGS / config), "--trainer.rounds=1", "--trainer.local_epochs=1",
            "--trainer.enable_progress_bar=false", "--data.num_clients=6",
            "--trainer.algorithm.init_args.num_neighbors=2", f"--trainer.default_root_dir={tmp_path / 'runs'}",
            *extra]


@pytest.fixture
def evilmod(tmp_path, monkeypatch) -> Path:
    """A module on the path that leaves a marker file when it is imported, with a callback class."""
    marker = tmp_path / "imported"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "evilmod_safe.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "from lightning.pytorch.callbacks import Callback\n\nclass Mine(Callback):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    return marker


def _refused(capsys, args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("lightning-dfl: error: "), err
    return lines[-1]


def test_a_config_may_never_name_what_ends_the_process(tmp_path, capsys):
    """jsonargparse's denylist, enforced (it only warned): ``schedule: os._exit`` ended a run with exit code 0."""
    line = _refused(capsys, _fit(tmp_path, "--trainer.callbacks+=lightning_dfl.callbacks.PQIPruning",
                                 "--trainer.callbacks.schedule=os._exit", config="dadpfl_digits.yaml"))
    assert "'os._exit' is refused" in line and "'os'" in line and "denylist" in line, line
    assert "unknown class" not in line, line


def test_safe_mode_refuses_another_module_before_importing_it(tmp_path, capsys, evilmod):
    line = _refused(capsys, ["--safe", *_fit(tmp_path, "--trainer.callbacks+=evilmod_safe.Mine")])
    assert "'evilmod_safe.Mine' is refused" in line and "--trust MODULE" in line, line
    assert "lightning_dfl, torch, torchvision, lightning" in line, line
    assert not evilmod.exists(), "the module was imported before it was refused"


def test_a_trusted_module_runs_in_safe_mode_and_the_policy_ends_with_the_command(tmp_path, capsys, evilmod):
    main(["--safe", "--trust", "evilmod_safe", *_fit(tmp_path, "--trainer.callbacks+=evilmod_safe.Mine")])
    assert evilmod.exists()
    assert len(list((tmp_path / "runs").rglob("summary.json"))) == 1  # it trained
    # the next command in this process is not in safe mode (jsonargparse's settings were restored): it may name
    # the module without trusting it
    main(_fit(tmp_path / "again", "--trainer.callbacks+=evilmod_safe.Mine"))
    assert len(list((tmp_path / "again" / "runs").rglob("summary.json"))) == 1


def test_safe_mode_refuses_a_builtin_as_a_hook(tmp_path, capsys):
    line = _refused(capsys, ["--safe", *_fit(tmp_path, "--trainer.callbacks+=LambdaCallback",
                                             "--trainer.callbacks.on_fit_start=builtins.print")])
    assert "'builtins.print' is refused" in line and "safe mode" in line, line


def test_safe_mode_refuses_a_callable_of_an_allowed_package_where_a_value_is_expected(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DFL_SAFE", "1")  # the environment variable is the flag
    line = _refused(capsys, _fit(tmp_path, "--trainer.callbacks+=lightning_dfl.callbacks.PQIPruning",
                                 "--trainer.callbacks.schedule=torch.is_nonzero", config="dadpfl_digits.yaml"))
    assert "trainer.callbacks[0].init_args.schedule" in line and "is_nonzero" in line, line
    assert "safe mode calls only functions of lightning_dfl" in line, line


def test_the_main_job_runs_in_safe_mode(tmp_path):
    main(["--safe", *_fit(tmp_path)])  # the README's first command, in safe mode
    assert len(list((tmp_path / "runs").rglob("summary.json"))) == 1


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["fit", "--safe", "-c", "x.yaml"], {}, (["fit", "-c", "x.yaml"], Policy(True, ()))),
    (["--safe", "fit", "--trust", "a", "--trust=b.c", "--trust", "a"], {}, (["fit"], Policy(True, ("a", "b.c")))),
    (["fit"], {"LIGHTNING_DFL_SAFE": "1", "LIGHTNING_DFL_TRUST": "m1, m2"}, (["fit"], Policy(True, ("m1", "m2")))),
    (["fit"], {"LIGHTNING_DFL_SAFE": "0"}, (["fit"], Policy(False, ()))),
])
def test_the_flags_and_the_environment(monkeypatch, args, env, expected):
    for name in ("LIGHTNING_DFL_SAFE", "LIGHTNING_DFL_TRUST"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert strip_flags(args) == expected


@pytest.mark.parametrize(("args", "named"), [
    (["fit", "--trust", "mymod"], ["--trust (mymod) widens safe mode", "--safe"]),
    (["fit", "--safe", "--trust"], ["--trust needs a module name", "nothing"]),
    (["fit", "--safe", "--trust", "--data.num_clients=4"], ["--trust needs a module name", "--data.num_clients"]),
    (["fit", "--safe", "--trust", "my-mod"], ["'my-mod' is not a module name"]),
    (["fit", "--safe", "--trust", "jsonargparse"], ["'jsonargparse' cannot be trusted"]),
])
def test_bad_trust_flags_are_refused(monkeypatch, capsys, args, named):
    for name in ("LIGHTNING_DFL_SAFE", "LIGHTNING_DFL_TRUST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError) as err:
        strip_flags(args)
    for word in named:
        assert word in str(err.value), str(err.value)
    line = _refused(capsys, args)  # and through the entry point, one line
    assert named[0] in line


def test_python_m_does_not_import_from_the_working_folder_unless_pythonpath_names_it(tmp_path):
    """``python -m lightning_dfl`` has the import path of the ``lightning-dfl`` command (``python -m`` alone put the
    working folder first, so a config could import a module lying there)."""
    import os
    import subprocess
    import sys

    marker = tmp_path / "imported"
    (tmp_path / "cwdmod_safe.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "from lightning_dfl.federation.algorithms import DisPFL\n\nclass Foo(DisPFL):\n    pass\n")
    command = [sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / "dispfl_digits.yaml"),
               "--trainer.algorithm.class_path=cwdmod_safe.Foo", "--print_config"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    refused = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and not marker.exists(), refused.stderr
    assert "PYTHONPATH=." in refused.stderr and "cwdmod_safe" in refused.stderr, refused.stderr
    allowed = subprocess.run(command, cwd=tmp_path, env={**env, "PYTHONPATH": "."}, capture_output=True, text=True,
                             timeout=300)
    assert allowed.returncode == 0 and marker.exists(), allowed.stderr
    assert "class_path: cwdmod_safe.Foo" in allowed.stdout
