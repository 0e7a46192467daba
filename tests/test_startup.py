"""Start-up: ``lightning-dfl --help``, ``--version`` and an unknown subcommand's error import no torch or Lightning.

Asserted on the modules imported (in a fresh interpreter), never on wall time.
"""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "torchvision", "lightning", "lightning_fabric", "pytorch_lightning", "sklearn", "torchmetrics")

PROBE = """
import json, sys
from lightning_dfl.cli import main
try:
    main({args!r})
except SystemExit as err:
    code = err.code
else:
    code = 0
sys.stdout.flush()
print("\\n" + json.dumps({{"code": code, "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


def _probe(args):
    done = subprocess.run([sys.executable, "-c", PROBE.format(args=args, heavy=HEAVY)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done


@pytest.mark.parametrize("args, code", [(["--help"], 0), ([], 0), (["--version"], 0), (["fitt"], 2),
                                        (["--data.dataset=digits"], 2)])
def test_top_level_paths_import_no_torch_or_lightning(args, code):
    result, done = _probe(args)
    assert result["code"] == code
    assert result["heavy"] == [], f"lightning-dfl {' '.join(args)} imported {result['heavy']}"
    if args == ["fitt"]:
        assert "did you mean 'fit'" in done.stderr


def test_importing_the_package_and_cli_imports_no_torch():
    code = ("import sys, lightning_dfl, lightning_dfl.cli, lightning_dfl.cli.analysis, lightning_dfl.cli.kept_help, "
            "lightning_dfl.cli.fit_help, lightning_dfl.cli.plot, lightning_dfl.cli.config_files; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_fit_classes_are_still_reachable_from_the_cli_module():
    from lightning_dfl import cli
    from lightning_dfl.cli.errors import user_errors
    from lightning_dfl.cli.fit import FederatedArgumentParser, FederatedCLI

    assert cli.FederatedCLI is FederatedCLI and cli.FederatedArgumentParser is FederatedArgumentParser
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    assert MisconfigurationException in user_errors()


@pytest.mark.parametrize("args, code", [
    (["--help"], 0), ([], 0), (["--version"], 0), (["fit", "--help"], 0), (["fit", "--trainer.clock.help=Clock"], 0),
    (["schedule", "--help"], 0), (["schedule", "--num_clients=20", "--neighbors=[3]", "--rounds=50"], 1)])
def test_a_closed_stdout_ends_quietly_with_a_fixed_code(args, code):
    """``lightning-dfl --help | head -1``: the reader closes the pipe (here before the child writes anything, so
    every write fails): no traceback; exit code 0 for a help or version text, 1 for a command's cut output."""
    child = subprocess.Popen([sys.executable, "-m", "lightning_dfl", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()  # before the child, still starting Python, writes anything
    err = child.stderr.read().decode()
    child.stderr.close()
    assert child.wait(timeout=300) == code
    assert err == ""


@pytest.mark.parametrize("args, expected", [([], True), (["--version"], True), (["fit", "-h"], True),
                                            (["fit", "--trainer.algorithm.help=DADPFL"], True),
                                            (["fit", "--trainer.algorithm.help", "DADPFL"], True),
                                            (["fit", "--config", "help.yaml"], False), (["cost", "--runs=[a]"], False)])
def test_help_requests_are_recognized(args, expected):
    from lightning_dfl.cli.entry import is_help_request

    assert is_help_request(args) is expected


@pytest.mark.parametrize("args", [["fit", "--help"], ["fit", "--trainer.algorithm.help=DADPFL"],
                                  ["fit", "--trainer.clock.help", "Clock"], ["fit", "--trainer.callbacks.help=RigL"]])
def test_a_first_fit_help_is_shown_without_torch_from_the_kept_texts(tmp_path, monkeypatch, args):
    """A fresh clone's first ``fit --help`` (or a class's help), with an empty cache, is the text kept in the
    package for these sources: no torch, no Lightning, nothing written to the cache."""
    import json

    from lightning_dfl.cli.kept_help import KEPT_HELP, help_environment

    kept = json.loads(KEPT_HELP.read_text())["environment"]
    if kept != help_environment():  # texts kept for other versions are not shown (rendered as usual)
        pytest.skip(f"the kept help texts were written with {kept}, this is {help_environment()}")
    monkeypatch.setenv("LIGHTNING_DFL_CACHE", str(tmp_path))
    monkeypatch.delenv("COLUMNS", raising=False)
    result, done = _probe(args)
    assert result["code"] == 0 and result["heavy"] == [], result
    assert "usage: lightning-dfl" in done.stdout and not (tmp_path / "help").exists()


@pytest.mark.parametrize("args, name", [(["fit", "--help"], "fit"), (["fit", "--trainer.clock.help=Clock"], "class")])
def test_fit_help_is_kept_and_then_shown_without_torch(tmp_path, monkeypatch, args, name):
    """In a terminal narrower than the kept texts (or for other sources), the first help imports torch and
    Lightning (seconds); the next ones read the text kept in the user's cache."""
    monkeypatch.setenv("LIGHTNING_DFL_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "79")
    first, first_run = _probe(args)
    second, second_run = _probe(args)
    assert first["code"] == second["code"] == 0
    assert "torch" in first["heavy"] and second["heavy"] == []
    help_text = first_run.stdout.rsplit("\n{", 1)[0]  # the probe's own last line apart
    assert second_run.stdout.rsplit("\n{", 1)[0] == help_text and "usage: lightning-dfl" in help_text
    assert [p.name for p in (tmp_path / "help").iterdir()] == [next((tmp_path / "help").glob(f"{name}-*.txt")).name]
