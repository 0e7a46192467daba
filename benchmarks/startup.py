"""How long `lightning-dfl` takes before it does anything, against a floor that shares no code with ours.

Each command runs as a fresh process, ``--repeats`` times, alternating so that a machine whose speed drifts
loads every command alike; the minimum and median wall times are reported:

* ``floor: import torch, lightning``: ``python -c "import torch, torchvision, lightning.pytorch"``, what any
  Lightning command imports before it can read its first option (no code of ours);
* ``--version``, ``fit --help`` (the kept text: no torch), ``schedule --help``;
* ``fit, refused value``: ``fit --config configs/dispfl_digits.yaml --trainer.rounds 0``, refused after the
  configuration is parsed, i.e. the whole start-up a user waits for before a run's set-up;
* ``fit, to the first round``: the main job for one round, with the start-up its summary prints
  (``summary.json``'s ``startup_s``: from the process's start to the first round, data and model included).

    python benchmarks/startup.py                # ~2 min on 2 cores
    python benchmarks/startup.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_time import cpu_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "lightning_dfl"]
CONFIG = str(REPO / "configs" / "dispfl_digits.yaml")


def commands(root: str) -> dict[str, list[str]]:
    return {
        "floor: import torch, torchvision, lightning": [sys.executable, "-c",
                                                        "import torch, torchvision, lightning.pytorch"],
        "--version": [*CLI, "--version"],
        "fit --help": [*CLI, "fit", "--help"],
        "schedule --help": [*CLI, "schedule", "--help"],
        "fit, refused value (--trainer.rounds 0)": [*CLI, "fit", "--config", CONFIG, "--trainer.rounds", "0"],
        "fit, 1 round of the main job": [*CLI, "fit", "--config", CONFIG, "--trainer.rounds", "1",
                                         "--trainer.enable_progress_bar", "false",
                                         f"--trainer.default_root_dir={root}", "--trainer.logger", "csv"],
    }


def run_once(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "startup_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        todo = commands(root)
        walls: dict[str, list[float]] = {name: [] for name in todo}
        for _ in range(args.repeats):
            for name, command in todo.items():
                walls[name].append(run_once(command))
        startups = [json.loads(p.read_text())["startup_s"] for p in sorted(Path(root).rglob("summary.json"))]
    cpu, flags = cpu_description()
    rows = [{"command": name, "min_s": min(w), "median_s": statistics.median(w), "walls_s": w}
            for name, w in walls.items()]
    result = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "repeats": args.repeats,
              "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "fit_startup_s (summary.json)": {"min": min(startups), "median": statistics.median(startups)}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    lines = [f"{cpu} ({', '.join(flags)}), {os.cpu_count()} cores, {args.repeats} runs each, {result['date']}", "",
             "| command | min (s) | median (s) |", "|---|---|---|"]
    lines += [f"| {r['command']} | {r['min_s']:.2f} | {r['median_s']:.2f} |" for r in rows]
    s = result["fit_startup_s (summary.json)"]
    lines.append(f"| start-up the 1-round fit's summary printed | {s['min']:.2f} | {s['median']:.2f} |")
    text = "\n".join(lines)
    Path(args.out).with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
