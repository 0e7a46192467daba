"""DA-DPFL's cost model (Sec. VI-A5; papers' README "Cost model")."""

import numpy as np
import pytest

from lightning_dfl.cost import CostModel, Workload, read_round_metrics, run_cost_curve

MIB = 2**20

# DA-DPFL Table II, CIFAR10 (ResNet18): busiest communication per round (MB; 426.3 for dense
# ResNet18 x 10 models is MiB, see the papers' README) and final training FLOPs per client per
# round (1e12). DA-DPFL_Dir: 149.1 MB, 4.1e12; DisPFL: 223.1 MB, 7.1e12. Mean delay: 17 tasks
# for DA-DPFL at M = N = 10 (simulated clock), 0 for DisPFL.
DA_DPFL = Workload(flops=4.1e12, bytes=149.1 * MIB, mean_delay=17.0)
DISPFL = Workload(flops=7.1e12, bytes=223.1 * MIB, mean_delay=0.0)


def test_component_formulas_hand_computed():
    m = CostModel()
    assert m.compute_time(8e12) == pytest.approx(5 * 8e12 / 80e12)  # 0.5 s
    assert m.compute_energy(8e12) == pytest.approx(450 * 0.5)
    assert m.comm_time(125e6) == pytest.approx(1.0)  # 1 Gbit over 1 Gbps
    assert m.comm_energy(125e6) == pytest.approx(1.0)
    assert m.energy(8e12, 125e6) == pytest.approx(226.0)
    assert m.time(8e12, 125e6) == pytest.approx(1.5)
    assert m.time(8e12, 125e6, mean_delay=3) == pytest.approx(6.0)
    assert m.total(0.0, 8e12, 125e6, 3) == pytest.approx(6.0)
    assert m.total(1.0, 8e12, 125e6, 3) == pytest.approx(226.0)
    assert m.total(0.25, 8e12, 125e6, 3) == pytest.approx(0.75 * 6 + 0.25 * 226)


def test_custom_model_and_arrays():
    m = CostModel(flops_per_second=1e12, flops_multiplier=1.0, compute_power_w=100.0,
                  bandwidth_bps=8e6, network_power_w=2.0)
    assert m.compute_time(3e12) == pytest.approx(3.0)
    assert m.comm_energy(1e6) == pytest.approx(2.0)
    np.testing.assert_allclose(m.comm_time(np.array([1e6, 2e6])), [1.0, 2.0])
    curve = m.curve([0.0, 0.5, 1.0], 1e12, 1e6, 1.0)
    # time = 2 (1 + 1) = 4 s, energy = 100 + 2 = 102 J
    np.testing.assert_allclose(curve, [4.0, 53.0, 102.0])


def test_table_ii_cifar10_crossing_at_0_22():
    m = CostModel()
    theta = m.crossing_theta(DA_DPFL, DISPFL)
    assert theta == pytest.approx(0.22, abs=0.01)
    assert m.crossing_theta(DISPFL, DA_DPFL) == pytest.approx(theta)
    # DA-DPFL costs more for time-sensitive use, less beyond the crossing (Fig. 3).
    assert m.workload_total(0.1, DA_DPFL) > m.workload_total(0.1, DISPFL)
    assert m.workload_total(0.4, DA_DPFL) < m.workload_total(0.4, DISPFL)
    at = m.workload_total(theta, DA_DPFL)
    assert at == pytest.approx(m.workload_total(theta, DISPFL))
    # Read as 10^6 bytes instead, the crossing is 0.219: within the same tolerance.
    as_mb = m.crossing_theta(Workload(4.1e12, 149.1e6, 17.0), Workload(7.1e12, 223.1e6, 0.0))
    assert as_mb == pytest.approx(0.22, abs=0.01)


def test_no_crossing_when_one_method_dominates():
    m = CostModel()
    cheap, dear = Workload(1e12, 1e6), Workload(2e12, 2e6)
    assert m.crossing_theta(cheap, dear) is None
    assert m.crossing_theta(cheap, cheap) is None


@pytest.mark.parametrize("kwargs", [{"flops_per_second": 0.0}, {"bandwidth_bps": -1.0},
                                    {"compute_power_w": -1.0}, {"flops_multiplier": float("nan")}])
def test_cost_model_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        CostModel(**kwargs)


def test_input_validation():
    m = CostModel()
    with pytest.raises(ValueError, match="theta"):
        m.total(1.5, 1e12, 1e6)
    with pytest.raises(ValueError, match="flops"):
        m.compute_time(-1.0)
    with pytest.raises(ValueError, match="mean_delay"):
        m.time(1.0, 1.0, mean_delay=-2)
    with pytest.raises(ValueError, match="Workload.bytes"):
        Workload(1.0, -1.0)


CSV = """\
step,epoch,round,flops/train_per_client,comm/busiest_bytes,time/delay,acc/mean
0,0,0,,,,
0,0,0,8e12,125000000,1,0.1
1,0,1,,,,0.2
1,0,1,8e12,62500000,3,
2,0,2.0,4e12,62500000,0,0.3
,,,,,,0.4
"""


def _write(tmp_path, text=CSV):
    path = tmp_path / "metrics.csv"
    path.write_text(text)
    return path


def test_read_round_metrics_merges_csvlogger_rows(tmp_path):
    rows = read_round_metrics(_write(tmp_path), ["flops/train_per_client", "time/delay"])
    assert rows == {0: {"flops/train_per_client": 8e12, "time/delay": 1.0},
                    1: {"flops/train_per_client": 8e12, "time/delay": 3.0},
                    2: {"flops/train_per_client": 4e12, "time/delay": 0.0}}


def test_run_cost_curve_from_metrics_csv(tmp_path):
    path = _write(tmp_path)
    # Per round: T_comp = 0.5, 0.5, 0.25 s; T_comm = 1, 0.5, 0.5 s; delay 1, 3, 0.
    times = [2 * 1.5, 4 * 1.0, 1 * 0.75]
    energies = [225 + 1, 225 + 0.5, 112.5 + 0.5]
    curve = run_cost_curve(path, thetas=[0.0, 0.5, 1.0])
    assert curve.rounds == 3
    assert curve.time == pytest.approx(sum(times))
    assert curve.energy == pytest.approx(sum(energies))
    np.testing.assert_allclose(curve.total, [sum(times), (sum(times) + sum(energies)) / 2, sum(energies)])
    last = run_cost_curve(path, thetas=[0.0, 1.0], reduce="last")
    np.testing.assert_allclose(last.total, [times[-1], energies[-1]])
    mean = run_cost_curve(path, thetas=[0.0], reduce="mean")
    assert mean.time == pytest.approx(sum(times) / 3)
    # A method that does not wait: no delay column needed.
    no_delay = run_cost_curve(path, thetas=[0.0], delay_col=None)
    assert no_delay.time == pytest.approx(1.5 + 1.0 + 0.75)


def test_run_cost_curve_custom_columns_and_errors(tmp_path):
    path = _write(tmp_path, "r,f,b\n0,8e12,125000000\n")
    curve = run_cost_curve(path, thetas=[0.0], round_col="r", flops_col="f", bytes_col="b", delay_col=None)
    assert curve.time == pytest.approx(1.5)
    with pytest.raises(ValueError, match="time/delay"):
        run_cost_curve(_write(tmp_path, "round,flops/train_per_client,comm/busiest_bytes\n0,1,1\n"))
    with pytest.raises(ValueError, match="reduce"):
        run_cost_curve(path, reduce="max")
    with pytest.raises(ValueError, match="no round"):
        run_cost_curve(_write(tmp_path, "round,flops/train_per_client,comm/busiest_bytes,time/delay\n"
                                        "0,,,\n"))


def test_a_metrics_csv_cut_short_warns_and_leaves_the_cut_row_out(tmp_path):
    from lightning_dfl.cost import read_round_metrics

    path = tmp_path / "metrics.csv"
    whole = "round,acc/headline,x\n0,0.5,1\n1,0.6,2\n2,0.7,3\n"
    path.write_text(whole)
    assert list(read_round_metrics(path, ["acc/headline"])) == [0, 1, 2]
    path.write_text(whole[:-3])  # the run stopped while writing round 2's row: "2,0.7"
    with pytest.warns(UserWarning, match=r"metrics.csv': 1 row\(s\) cut short \(line\(s\) 4: fewer cells"):
        rounds = read_round_metrics(path, ["acc/headline"])
    assert rounds == {0: {"acc/headline": 0.5}, 1: {"acc/headline": 0.6}}
