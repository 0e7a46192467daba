"""The golden record: the engine's results on the digits set do not move by accident.

``tests/golden/engine_runs.pt`` holds, for DisPFL, DA-DPFL (voting and PQI firing, uneven client
speeds), D-PSGD, Local and FedAvg, every metric of every round (wall times aside), the per-client
rows of ``clients.csv`` and every node's final weights and masks. A refactor must reproduce them bit
for bit (on a machine with the recording's torch version and CPU kernels); a deliberate change re-records them (``python tests/golden/record.py``) in its own commit.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("golden_record", Path(__file__).parent / "golden" / "record.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


@pytest.fixture(scope="module")
def recorded():
    return torch.load(golden.PATH, weights_only=True)


@pytest.mark.parametrize("name", list(golden.RUNS))
def test_golden_run_is_reproduced_bit_for_bit(name, recorded, tmp_path):
    machine = golden.recorded_on(recorded, name)
    if machine != golden.machine():  # other kernels round differently
        pytest.skip(f"recorded with {machine}, this is {golden.machine()}: re-record to compare")
    expected, got = recorded[name], golden.run(name, str(tmp_path))
    assert len(got["metrics"]) == len(expected["metrics"])
    for round_idx, (e, g) in enumerate(zip(expected["metrics"], got["metrics"])):
        assert g == e, f"round {round_idx}: {sorted(set(e.items()) ^ set(g.items()))}"
    assert got["clients"] == expected["clients"]
    assert len(got["nodes"]) == len(expected["nodes"])
    for node, (e, g) in enumerate(zip(expected["nodes"], got["nodes"])):
        for part in ("weights", "published_mask", "mask"):
            assert set(g[part]) == set(e[part]), (node, part)
            for key in e[part]:
                assert g[part][key] == e[part][key], f"node {node} {part} {key}"
