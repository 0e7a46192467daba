"""What a run writes stays valid whatever its numbers: ``summary.json`` is strict JSON."""

from __future__ import annotations

import json
import math

import numpy as np

from lightning_dfl.federation.report import RunSummary


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
