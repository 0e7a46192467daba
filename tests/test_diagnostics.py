"""Diagnostics (issue 17): realized mixing matrix and spectral gap, consensus distance, mask Jaccard and
flips, the bytes matrix, per-client accuracy spread, the switches, bit-identical training with them on and
off, and ``lightning-dfl plot diagnostics``."""

import csv
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer, RoundContext, RoundPlan, Source, Task
from lightning_dfl.federation.algorithms import DADPFL, DPSGD, PSFL, DFedSAM, DisPFL, FedAvg, Local
from lightning_dfl.federation.metrics import diagnostics as D
from lightning_dfl.federation.metrics import mixing, spread
from lightning_dfl.federation.store import DenseClientStore
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _ctx(k, round_idx=0, sample_counts=None):
    return RoundContext(round_idx, 10, k, tuple(sample_counts or [10] * k), np.random.default_rng(round_idx))


def _gap(algorithm, k=8, sample_counts=None):
    algorithm.validate(k)
    plan = algorithm.plan_round(_ctx(k, sample_counts=sample_counts))
    w = mixing.mixing_matrix([plan], k, k + algorithm.num_servers)
    return mixing.spectral_gap(w, mixing.participants_of([plan], k)), w


# -- the realized mixing matrix and its spectral gap ---------------------------------------------------


def test_ring_one_neighbour_each_side_has_the_circulant_closed_form_gap():
    (gap, rho), w = _gap(DPSGD(num_neighbors=2, topology="ring"))
    assert torch.allclose(w.sum(1), torch.ones(8, dtype=torch.float64))
    assert w[0, 0] == w[0, 1] == w[0, 7] == pytest.approx(1 / 3)
    assert gap == pytest.approx(1 - (1 + 2 * math.cos(2 * math.pi / 8)) / 3, abs=1e-12)
    assert rho == pytest.approx(1 - gap, abs=1e-15)


def test_ring_two_neighbours_each_side_has_the_circulant_closed_form_gap():
    (gap, _), w = _gap(DPSGD(num_neighbors=4, topology="ring"))
    assert w[3, 1] == w[3, 5] == pytest.approx(1 / 5)
    eigen = [(1 + 2 * math.cos(2 * math.pi * j / 8) + 2 * math.cos(4 * math.pi * j / 8)) / 5 for j in range(1, 8)]
    assert gap == pytest.approx(1 - max(abs(e) for e in eigen), abs=1e-12)


def test_full_topology_has_gap_one_and_local_gap_zero():
    (gap, rho), w = _gap(DPSGD(topology="full"))
    assert torch.allclose(w, torch.full((8, 8), 1 / 8, dtype=torch.float64))
    assert gap == pytest.approx(1.0, abs=1e-12) and rho == pytest.approx(0.0, abs=1e-12)
    (gap, rho), w = _gap(Local())
    assert torch.equal(w, torch.eye(8, dtype=torch.float64))
    assert gap == pytest.approx(0.0, abs=1e-12) and rho == pytest.approx(1.0, abs=1e-12)


def test_fedavg_server_average_is_rank_one_over_participants_with_gap_one():
    counts = [5, 10, 20, 40, 15, 10]
    (gap, rho), w = _gap(FedAvg(clients_per_round=3), k=6, sample_counts=counts)
    plan = FedAvg(clients_per_round=3).plan_round(_ctx(6, sample_counts=counts))
    sampled = plan.meta["sampled"]
    c = torch.tensor([counts[k] for k in sampled], dtype=torch.float64)
    for k in range(6):
        if k in sampled:  # every participant starts from the server's sample-weighted average
            assert torch.allclose(w[k, sampled], c / c.sum())
        else:  # non-participants keep their own model
            assert torch.equal(w[k], torch.eye(6, dtype=torch.float64)[k])
    assert gap == pytest.approx(1.0, abs=1e-12) and rho == pytest.approx(0.0, abs=1e-12)


def test_dadpfl_posterior_reuse_composes_rows_by_hand():
    # order 2, 0, 1, 3; 0 reuses 2's fresh model, 1 reuses 0's, 3 reuses 1's and 2's (DA-DPFL's shape)
    plan = RoundPlan(0, [
        Task(2, sources=(Source(2), Source(3))),
        Task(0, sources=(Source(0), Source(2, fresh=True), Source(1))),
        Task(1, sources=(Source(1), Source(0, fresh=True))),
        Task(3, sources=(Source(3), Source(1, fresh=True), Source(2, fresh=True))),
    ])
    e = torch.eye(4, dtype=torch.float64)
    r2 = (e[2] + e[3]) / 2
    r0 = (e[0] + r2 + e[1]) / 3
    r1 = (e[1] + r0) / 2
    r3 = (e[3] + r1 + r2) / 3
    assert torch.allclose(mixing.mixing_matrix([plan], 4), torch.stack([r0, r1, r2, r3]), atol=1e-15)
    # the same through DA-DPFL's own planner: every fresh source is replaced by its task's row
    algorithm = DADPFL(num_neighbors=2, max_wait=2)
    algorithm.validate(4)
    plan = algorithm.plan_round(_ctx(4))
    assert any(s.fresh for t in plan.tasks for s in t.sources)
    rows = {}
    for task in plan.order():
        rows[task.node] = sum((rows[s.node] if s.fresh else e[s.node]) for s in task.sources) / len(task.sources)
    assert torch.allclose(mixing.mixing_matrix([plan], 4), torch.stack([rows[k] for k in range(4)]), atol=1e-15)


def test_exchanges_compose_and_coefficients_weight_rows():
    first = RoundPlan(0, [Task(0, sources=(Source(0), Source(1)), coefficients=(3.0, 1.0)), Task(1), Task(2)])
    gossip = RoundPlan(0, [Task(k, sources=(Source(k), Source((k + 1) % 3)), train=False) for k in range(3)])
    w0, w1 = mixing.mixing_matrix([first], 3), mixing.mixing_matrix([gossip], 3)
    assert torch.allclose(w0[0], torch.tensor([0.75, 0.25, 0.0], dtype=torch.float64))
    assert torch.allclose(mixing.mixing_matrix([first, gossip], 3), w1 @ w0)


@pytest.mark.parametrize("algorithm", [DFedSAM(num_neighbors=2, gossip_steps=3), PSFL(clients_per_round=4, sequences=2, warmup_rounds=0)],
                         ids=["dfedsam-mgs", "psfl"])
def test_multi_exchange_and_server_chains_give_row_stochastic_w(algorithm):
    algorithm.validate(6)
    plans = []
    for exchange in range(algorithm.exchanges_per_round):
        ctx = RoundContext(3, 10, 6, (10,) * 6, np.random.default_rng(exchange), exchange=exchange)
        plans.append(algorithm.plan_round(ctx))
    w = mixing.mixing_matrix(plans, 6, 6 + algorithm.num_servers)
    assert torch.allclose(w.sum(1), torch.ones(6, dtype=torch.float64))
    assert (w >= 0).all()


# -- consensus distance ------------------------------------------------------------------------------------


def _store(weights, masks):
    """A store of len(weights) nodes with one parameter "w" (masked) holding the given vectors."""
    weights = torch.tensor(weights, dtype=torch.float32)
    masks = torch.tensor(masks, dtype=torch.bool)
    store = DenseClientStore({"w": weights[0]}, ["w"], len(weights))
    for k in range(len(weights)):
        store.initialize(k, {"w": weights[k]}, {"w": masks[k]})
    return store


def test_consensus_distance_equals_a_hand_computation():
    store = _store([[1, 2], [3, 0], [2, 4]], [[1, 1]] * 3)
    pairs = mixing.all_pairs(3)
    dense, masked = spread.consensus_distances(store, [0, 1, 2], ["w"], pairs)
    assert dense == pytest.approx((1 + 5 + 4) / 3, rel=1e-6)  # mean (2, 2): |(-1,0)|^2, |(1,-2)|^2, |(0,2)|^2
    assert masked == pytest.approx(dense, rel=1e-6)  # identical masks, all pairs: the same quantity


def test_consensus_distance_is_zero_for_identical_models_and_masked_keeps_shared_weights():
    store = _store([[1.5, -2.0]] * 3, [[1, 1]] * 3)
    assert spread.consensus_distances(store, [0, 1, 2], ["w"], mixing.all_pairs(3)) == (0.0, 0.0)  # exactly
    # personal masks: x1 = (1, 0), x2 = (3, 0), x3 = (0, 4) with masks (1,0), (1,1), (0,1)
    store = _store([[1, 0], [3, 0], [0, 4]], [[1, 0], [1, 1], [0, 1]])
    dense, masked = spread.consensus_distances(store, [0, 1, 2], ["w"], mixing.all_pairs(3))
    x = np.array([[1, 0], [3, 0], [0, 4]], dtype=float)
    assert dense == pytest.approx(((x - x.mean(0)) ** 2).sum() / 3, rel=1e-6)
    # shared weights: (0,1) entry 0: (1-3)^2 = 4; (0,2) none: 0; (1,2) entry 1: (0-4)^2 = 16
    assert masked == pytest.approx((3 - 1) / (2 * 3) * (4 + 0 + 16) / 3, rel=1e-6)


@pytest.mark.parametrize("kind", ["dense", "compact"])
def test_consensus_distances_in_many_blocks_and_pair_chunks_match_float64(kind, monkeypatch):
    """Blocks of columns, pairs in chunks, float64 sums: however the parameter is cut (here 30 blocks and 5 chunks
    of pairs) the results are the float64 formulas' up to one float32 rounding per entry (a centred entry, a pair
    difference: ~1e-10 and ~1e-13 here; float32 sums of the blocks were off by ~1e-5)."""
    from lightning_dfl.federation.store.factory import store_class
    monkeypatch.setattr(spread, "BLOCK_ELEMENTS", 4096)
    gen = torch.Generator().manual_seed(0)
    k, n = 10, 11_000
    masks = torch.rand(k, n, generator=gen) < 0.5
    weights = (1000 + torch.randn(k, n, generator=gen)) * masks  # a large mean: centring matters
    store = store_class(kind)({"w": weights[0]}, ["w"], k)
    for i in range(k):
        store.initialize(i, {"w": weights[i]}, {"w": masks[i]})
    pairs = mixing.all_pairs(k)
    assert len(pairs) == 45 and spread._step(k, "cpu", 64) == 384
    dense, masked = spread.consensus_distances(store, list(range(k)), ["w"], pairs)
    x, m = weights.double().numpy(), masks.numpy()
    assert dense == pytest.approx(((x - x.mean(0)) ** 2).sum() / k, rel=1e-9)
    shared = [(((x[i] - x[j]) * (m[i] & m[j])) ** 2).sum() for i, j in pairs]
    assert masked == pytest.approx((k - 1) / (2 * k) * np.mean(shared), rel=1e-12)


# -- mask Jaccard and flips ---------------------------------------------------------------------------------


def test_jaccard_identical_disjoint_and_independent_masks():
    n = 4000
    a = torch.zeros(n, dtype=torch.bool)
    a[: n // 2] = True
    store = _store([[0.0] * n] * 3, [a.tolist(), a.tolist(), (~a).tolist()])
    packed = spread.packed_masks(store, [0, 1, 2])
    assert spread.jaccard_pairs(packed, [(0, 1), (0, 2), (1, 2)]).tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(spread.jaccard_matrix(store, [0, 1, 2]), torch.tensor(
        [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64))
    # independent uniform masks of density d: E[J] = d^2 / (2d - d^2) = d / (2 - d)
    generator = torch.Generator().manual_seed(0)
    for d in (0.1, 0.5, 0.8):
        masks = torch.rand((12, 50_000), generator=generator) < d
        store = _store([[0.0] * 50_000] * 12, masks.tolist())
        jaccard = spread.jaccard_pairs(spread.packed_masks(store, range(12)), mixing.all_pairs(12))
        assert float(jaccard.mean()) == pytest.approx(d / (2 - d), abs=0.01)
        full = spread.jaccard_matrix(store, list(range(12)))
        assert torch.allclose(full[torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)], jaccard)


def test_packed_bits_count_exactly_and_flips_are_the_changed_share():
    generator = torch.Generator().manual_seed(1)
    x, y = torch.rand((5, 1000), generator=generator) < 0.3, torch.rand((5, 1000), generator=generator) < 0.6
    px, py = spread.pack_words(x), spread.pack_words(y)
    assert torch.equal(spread.popcount(px), x.sum(1)) and torch.equal(spread.popcount(px & py), (x & y).sum(1))
    assert torch.allclose(spread.flip_fractions(px, py, 1000), (x ^ y).sum(1).double() / 1000)


def test_pair_sampling_above_the_threshold_is_linear_in_k_and_seeded():
    small = mixing.diagnostic_pairs(mixing.ALL_PAIRS_MAX_K, 0, 0)
    assert len(small) == mixing.ALL_PAIRS_MAX_K * (mixing.ALL_PAIRS_MAX_K - 1) // 2
    k = 200
    pairs = mixing.diagnostic_pairs(k, 3, 7)
    assert len(pairs) == len(set(pairs)) == mixing.JACCARD_PAIRS_PER_CLIENT * k
    assert all(0 <= i < j < k for i, j in pairs)
    assert pairs == mixing.diagnostic_pairs(k, 3, 7) and pairs != mixing.diagnostic_pairs(k, 4, 7)


def test_personal_spread():
    values = spread.personal_spread([0.5, 0.9, 0.1, 0.7])
    assert values == {"acc/personal_min": 0.1, "acc/personal_p10": pytest.approx(0.22),
                      "acc/personal_max": 0.9}
    assert spread.personal_spread([]) == {}


# -- in a run ------------------------------------------------------------------------------------------------


def _fit(algorithm, tmp_path, rounds=2, density=0.5, k=5, **options):
    dm = FederatedDataModule(dataset="digits", num_clients=k, batch_size=32, test_samples_per_client=20,
                             partition="dirichlet", alpha=0.5, seed=1)
    model = SparseClassifier(arch="cnn_digits", density=density, lr=0.05, seed=1)
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, local_epochs=1, accelerator="cpu",
                               enable_progress_bar=False, seed=3, default_root_dir=str(tmp_path), cpu_threads=1,
                               **options)
    trainer.fit(model, dm)
    return trainer


DIAG_METRICS = ("diag/spectral_gap", "diag/mixing_rho", "diag/consensus_distance", "diag/consensus_distance_masked",
                "diag/mask_jaccard_mean", "diag/mask_jaccard_min", "diag/mask_flip_fraction",
                "acc/personal_min", "acc/personal_p10", "acc/personal_max")


def test_diagnostics_change_no_trained_value(tmp_path):
    runs = [_fit(DADPFL(num_neighbors=2, max_wait=2), tmp_path / str(on), rounds=3, diagnostics=on)
            for on in (True, False)]
    on, off = runs
    assert "diag/spectral_gap" in on.history[0] and not any(k.startswith("diag/") for k in off.history[0])
    for a, b in zip(on.history, off.history):
        assert {k: v for k, v in a.items() if k.startswith("acc/")} == {k: v for k, v in b.items()
                                                                         if k.startswith("acc/")}
    for node in range(on.store.num_nodes):
        sa, sb = on.store.state(node), off.store.state(node)
        for part in ("weights", "published_mask", "mask"):
            for name, tensor in getattr(sa, part).items():
                assert torch.equal(tensor, getattr(sb, part)[name]), (node, part, name)


def test_metrics_files_and_bytes_total(tmp_path):
    trainer = _fit(DisPFL(num_neighbors=2), tmp_path, rounds=3)
    for metrics in trainer.history:
        assert all(key in metrics for key in DIAG_METRICS)
    log_dir = trainer.log_dir
    header = next(csv.reader(open(f"{log_dir}/metrics.csv")))
    assert set(DIAG_METRICS) <= set(header)
    folder = f"{log_dir}/{D.FOLDER}"
    bytes_matrix = D.read_matrix(f"{folder}/bytes.csv")
    assert bytes_matrix.shape == (5, 5) and np.all(np.diag(bytes_matrix) == 0)
    assert bytes_matrix.sum() == sum(m["comm/total_bytes"] for m in trainer.history)
    jaccard = D.read_matrix(f"{folder}/mask_jaccard.csv")
    assert jaccard.shape == (5, 5) and np.allclose(np.diag(jaccard), 1.0) and np.allclose(jaccard, jaccard.T)
    assert len(list(csv.DictReader(open(f"{folder}/client_labels.csv")))) == 5


def test_fedavg_bytes_matrix_includes_the_server(tmp_path):
    trainer = _fit(FedAvg(clients_per_round=2), tmp_path, rounds=2, density=1.0, k=4)
    matrix = D.read_matrix(f"{trainer.log_dir}/{D.FOLDER}/bytes.csv")
    assert matrix.shape == (5, 5) and matrix.sum() == sum(m["comm/total_bytes"] for m in trainer.history)
    assert trainer.history[-1]["diag/spectral_gap"] == pytest.approx(1.0, abs=1e-12)


def test_switches_and_their_errors(tmp_path):
    every = _fit(Local(), tmp_path, rounds=3, diag_every=2)
    assert ["diag/spectral_gap" in m for m in every.history] == [False, True, True]  # round 1 and the last
    off = _fit(Local(), tmp_path, rounds=1, diagnostics="auto")  # K = 5 <= 100: on
    assert "diag/consensus_distance" in off.history[0]
    for bad in ("maybe", 1, None):
        with pytest.raises(ValueError, match=r"diagnostics must be 'auto'.*true or false, got"):
            FederatedTrainer(algorithm=Local(), diagnostics=bad, logger=False)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=r"diag_every must be an integer >= 1, got"):
            FederatedTrainer(algorithm=Local(), diag_every=bad, logger=False)


def test_plot_command_draws_every_figure_of_a_finished_and_a_resumed_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from lightning_dfl.cli import main
    from lightning_dfl.plots import DIAGNOSTICS_FIGURES

    finished = _fit(DisPFL(num_neighbors=2), tmp_path / "a", rounds=3, checkpoint_every=1)
    main(["plot", "diagnostics", finished.log_dir])
    assert all((Path(finished.log_dir) / D.FOLDER / name).is_file() for name in DIAGNOSTICS_FIGURES)
    # resume from the checkpoint after round 1 into a new run folder: the earlier rounds' bytes are carried
    first = _fit(DisPFL(num_neighbors=2), tmp_path / "b", rounds=2, checkpoint_every=1)
    dm = FederatedDataModule(dataset="digits", num_clients=5, batch_size=32, test_samples_per_client=20,
                             partition="dirichlet", alpha=0.5, seed=1)
    resumed = FederatedTrainer(algorithm=DisPFL(num_neighbors=2), rounds=3, local_epochs=1, accelerator="cpu",
                               enable_progress_bar=False, seed=3, default_root_dir=str(tmp_path / "b"), cpu_threads=1,
                               checkpoint_every=1)
    resumed.fit(SparseClassifier(arch="cnn_digits", density=0.5, lr=0.05, seed=1), dm,
                ckpt_path=str(first.checkpoint_path))
    assert resumed.log_dir != first.log_dir
    total = D.read_matrix(f"{resumed.log_dir}/{D.FOLDER}/bytes.csv").sum()
    assert total == sum(m["comm/total_bytes"] for m in resumed.history)
    assert resumed.history[-1]["diag/spectral_gap"] == finished.history[-1]["diag/spectral_gap"]
    out = tmp_path / "figures"
    main(["plot", "diagnostics", resumed.log_dir, "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(DIAGNOSTICS_FIGURES)
    assert capsys.readouterr().out.count("figure: ") == 2 * len(DIAGNOSTICS_FIGURES)


def test_plot_command_errors(tmp_path, capsys):
    from lightning_dfl.cli import main

    for args, message in ((["plot", "diagnostic", str(tmp_path)], "unknown plot kind 'diagnostic'; allowed: diagnostics"),
                          (["plot", "diagnostics"], "needs a run folder"),
                          (["plot", "diagnostics", str(tmp_path / "nope")], "no run folder")):
        with pytest.raises(SystemExit) as err:
            main(args)
        assert err.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "metrics.csv").write_text("round,acc/headline\n0,0.5\n")
    with pytest.raises(SystemExit):
        main(["plot", "diagnostics", str(tmp_path)])
    assert "has no diag/* metrics" in capsys.readouterr().err


def test_the_round_accounting_is_the_one_byte_ledger():
    """``RoundAccounting.transfer`` counts a message and passes it on to its observer (the diagnostics),
    except a transfer replayed with ``notify=False``."""
    from lightning_dfl.federation.metrics.accounting import RoundAccounting

    class Recorder:
        def __init__(self):
            self.seen = []

        def transfer(self, sender, receiver, value_bytes, index_bytes=0):
            self.seen.append((sender, receiver, value_bytes, index_bytes))

    recorder = Recorder()
    accounting = RoundAccounting(3, observer=recorder)
    accounting.transfer(0, 1, 40, 2)
    accounting.transfer(1, 0, 8)
    accounting.transfer(2, 0, 4, 1, notify=False)
    assert recorder.seen == [(0, 1, 40, 2), (1, 0, 8, 0)]
    assert dict(accounting.upload) == {0: 40, 1: 8, 2: 4} and dict(accounting.mask_upload) == {0: 2, 2: 1}
    RoundAccounting(3).transfer(0, 1, 40, 2)  # no observer: counted only


def test_a_row_stochastic_w_that_pulls_towards_one_client_has_a_gap_in_0_1():
    # clients 0 and 1 keep their models, client 2 copies client 1: the disagreement's l2 norm may grow for a
    # round (largest singular value 1.15) but repeated mixing never widens it: rho = 1 (two fixed points)
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    gap, rho = mixing.spectral_gap(w)
    assert gap == pytest.approx(0.0, abs=1e-12) and rho == pytest.approx(1.0, abs=1e-12)
    gap, rho = mixing.spectral_gap(torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64))
    assert gap == pytest.approx(0.5, abs=1e-12)  # client 0 halves its distance to client 1's model each round


def test_under_heavy_dropout_the_realized_w_is_row_stochastic_and_the_gap_in_0_1(monkeypatch):
    seen = []
    original = mixing.spectral_gap

    def spy(w, participants=None):
        seen.append((w.clone(), list(participants)))
        return original(w, participants)

    monkeypatch.setattr(D, "spectral_gap", spy)
    dm = FederatedDataModule(dataset="digits", num_clients=20, batch_size=64, test_samples_per_client=10)
    trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=4), rounds=12, local_steps=1, eval_every=12,
                               logger=False, accelerator="cpu", enable_progress_bar=False, dropout=0.9,
                               diagnostics=True, seed=0)
    trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5), dm)
    assert len(seen) == 12
    for w, participants in seen:
        sub = w[participants][:, participants]
        assert torch.allclose(sub.sum(dim=1), torch.ones(len(participants), dtype=torch.float64))
    gaps = [m["diag/spectral_gap"] for m in trainer.history if not math.isnan(m["diag/spectral_gap"])]
    assert gaps and all(0.0 <= g <= 1.0 + 1e-12 for g in gaps), gaps


@pytest.mark.parametrize("p", [20, 43])
def test_the_spectral_gap_of_a_full_average_survives_lapacks_failure(p):
    """W = J (every participant takes the uniform mean of all: PSFL's warm-up, FedAvg over everyone): (I - J) W is
    rounding residue, on which torch's float64 eigvals fails to converge for P = 20 and 43. It ended 6 of 11 PSFL
    runs at dropout 0.1-0.3; the NumPy and Gelfand fallbacks give rho = 0, gap = 1."""
    w = torch.full((p, p), 1.0 / p, dtype=torch.float64)
    gap, rho = mixing.spectral_gap(w)
    assert rho == pytest.approx(0.0, abs=1e-12) and gap == pytest.approx(1.0, abs=1e-12)


def test_spectral_radius_falls_back_to_numpy_then_to_gelfands_formula(monkeypatch):
    """The three paths agree on matrices with known radii: a rotation-scaling, a Jordan block, a nilpotent one."""
    cases = [(torch.tensor([[0.0, -0.5], [0.5, 0.0]], dtype=torch.float64), 0.5),
             (torch.tensor([[0.7, 1.0, 0.0], [0.0, 0.7, 1.0], [0.0, 0.0, 0.7]], dtype=torch.float64), 0.7),
             (torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64), 0.0),
             (torch.zeros(3, 3, dtype=torch.float64), 0.0)]
    fail = lambda *a, **k: (_ for _ in ()).throw(torch.linalg.LinAlgError("failed to converge"))  # noqa: E731
    for m, rho in cases:
        assert mixing.spectral_radius(m) == pytest.approx(rho, abs=1e-9)
    monkeypatch.setattr(torch.linalg, "eigvals", fail)
    for m, rho in cases:
        assert mixing.spectral_radius(m) == pytest.approx(rho, abs=1e-9)
    monkeypatch.setattr(np.linalg, "eigvals", lambda a: (_ for _ in ()).throw(np.linalg.LinAlgError("no")))
    for m, rho in cases:
        assert mixing.spectral_radius(m) == pytest.approx(rho, rel=1e-6, abs=1e-9)  # Gelfand: ||M^k||^(1/k), k = 2^60
    assert math.isnan(mixing.spectral_radius(torch.tensor([[float("nan")]], dtype=torch.float64)))


def test_a_failing_diagnostic_is_logged_as_nan_with_one_warning_and_the_run_goes_on(monkeypatch):
    def broken(w, participants=None):
        raise RuntimeError("an unforeseen input")

    monkeypatch.setattr(D, "spectral_gap", broken)
    dm = FederatedDataModule(dataset="digits", num_clients=6, batch_size=64, test_samples_per_client=10)
    trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=2), rounds=3, local_steps=1, logger=False,
                               accelerator="cpu", enable_progress_bar=False, diagnostics=True, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SparseClassifier(arch="cnn_digits", density=0.5), dm)
    assert len(trainer.history) == 3
    assert all(math.isnan(m["diag/spectral_gap"]) and math.isnan(m["diag/mixing_rho"]) for m in trainer.history)
    assert all(not math.isnan(m["diag/consensus_distance"]) for m in trainer.history)  # the other diagnostics ran
    said = [w for w in caught if "diag/spectral_gap could not be computed" in str(w.message)]
    assert len(said) == 1 and "an unforeseen input" in str(said[0].message)


_UNDER_DROPOUT = {  # every algorithm at K = 8, as its digits config runs it (small settings)
    "beer": {}, "dadpfl": {"num_neighbors": 3, "max_wait": 3}, "dfedavgm": {"num_neighbors": 3}, "dfedsam": {"num_neighbors": 3},
    "dispfl": {"num_neighbors": 3}, "ditto": {"clients_per_round": 4}, "dpsgd": {"num_neighbors": 3},
    "dpsgd_ft": {"num_neighbors": 3}, "fedavg": {"clients_per_round": 4}, "fedavg_ft": {"clients_per_round": 4},
    "feddst": {"clients_per_round": 4}, "fedfomo": {"num_neighbors": 3}, "gossipfl": {}, "local": {},
    "prisam": {"num_groups": 2, "warmup_rounds": 1}, "psfl": {"clients_per_round": 8, "warmup_rounds": 2},
    "subfedavg": {"clients_per_round": 4},
}


@pytest.mark.parametrize("dropout", [0.3, 0.9])
@pytest.mark.parametrize("name", sorted(_UNDER_DROPOUT))
def test_every_algorithms_realized_mixing_matrices_under_dropout_have_a_gap(name, dropout, monkeypatch):
    """Under dropout every round's realized W (what the trainer hands the diagnostics) gets a gap in [0, 1] (or
    NaN with fewer than two participants), and the run ends normally."""
    from lightning_dfl.federation import ALGORITHMS

    seen = []
    original = mixing.spectral_gap

    def spy(w, participants=None):
        seen.append(original(w, participants))
        return seen[-1]

    monkeypatch.setattr(D, "spectral_gap", spy)
    dm = FederatedDataModule(dataset="digits", num_clients=8, batch_size=64, test_samples_per_client=10)
    prisam = name == "prisam"
    model = SparseClassifier(arch="vgg11" if prisam else "cnn_digits", density=1.0 if prisam or name == "psfl" else 0.5,
                             model_options={"norm": "batch"} if prisam else None)
    if prisam:
        dm = FederatedDataModule(dataset="digits", num_clients=8, batch_size=64, test_samples_per_client=10,
                                 image_size=32)
    trainer = FederatedTrainer(algorithm=ALGORITHMS.get(name)(**_UNDER_DROPOUT[name]), rounds=4, local_steps=1,
                               eval_every=4, logger=False, accelerator="cpu", enable_progress_bar=False,
                               dropout=dropout, diagnostics=True, seed=1)
    trainer.fit(model, dm)
    assert len(trainer.history) == 4 and len(seen) == 4
    for gap, rho in seen:
        assert (math.isnan(gap) and math.isnan(rho)) or (-1e-9 <= gap <= 1.0 + 1e-9 and gap == pytest.approx(1 - rho))
