"""``lightning-dfl fit ... | head``: the run outlives its closed stdout and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_a_run_whose_stdout_reader_is_gone_finishes_writes_its_summary_and_says_so(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_dfl", "fit", "--config", str(CONFIGS / "dispfl_digits.yaml"),
         "--trainer.rounds=2", "--trainer.local_epochs=1", f"--trainer.default_root_dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the first line: every write to stdout fails
    _, err = process.communicate(timeout=600)
    assert process.returncode == 1, err  # its printed output was cut short ...
    assert "Traceback" not in err and "Exception ignored" not in err, err
    summary = json.loads((tmp_path / "dispfl" / "version_0" / "summary.json").read_text())  # ... its results are not
    assert summary["rounds"] == 2, summary
    assert f"the run finished: its results are in {tmp_path / 'dispfl' / 'version_0'}" in err, err


def test_the_guard_writes_through_until_the_reader_goes(tmp_path):
    from lightning_dfl.federation.trainer.closed_stdout import StdoutGuard

    class Pipe:
        def __init__(self):
            self.text, self.open = "", True

        def write(self, text):
            if not self.open:
                raise BrokenPipeError
            self.text += text
            return len(text)

        def flush(self):
            if not self.open:
                raise BrokenPipeError

    pipe = Pipe()
    guard = StdoutGuard(pipe)
    assert guard.write("a") == 1 and pipe.text == "a" and not guard.closed_by_reader
    pipe.open = False
    guard.flush()
    assert guard.closed_by_reader and guard.write("bc") == 2 and pipe.text == "a"
