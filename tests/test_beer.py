"""BEER (Zhao et al., 2022; baselines notes section 7): compressed gradient tracking. On heterogeneous
quadratics f_i = a_i/2 ||x - b_i||^2 over a ring of 10 it reaches the exact optimum where D-PSGD with
a constant step keeps a bias; with C = identity and gamma = 1 it is gradient tracking; for any C the
mean of the V_i is the mean gradient at every step; on the engine a message costs what C sends."""

import math
import warnings

import pytest
import torch

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms.beer import (
    BEER,
    GSGDCodec,
    build_compressor,
    compress,
    descend,
    gsgd,
    track_gradient,
)
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

N, D = 10, 20


def _ring(n):
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] = 1 / 3  # 1/(deg + 1)
    return w


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = 0.5 + 1.5 * torch.rand(N, generator=gen, dtype=torch.float64)
    b = 3 * torch.randn(N, D, generator=gen, dtype=torch.float64)
    return a, b, (a[:, None] * b).sum(0) / a.sum()


def _beer(codec, gamma, eta, steps, seed=0, check=None):
    """BEER on the quadratics, agents as rows, with the update functions the algorithm uses."""
    a, b, x_star = _problem(seed)
    w, gen = _ring(N), torch.Generator().manual_seed(seed + 1)

    def grad(x):
        return a[:, None] * (x - b)

    def c(m):  # C applied to each agent's vector
        return torch.stack([compress(codec, {"x": row}, gen)[0]["x"] for row in m])

    x = torch.zeros(N, D, dtype=torch.float64)
    v, h, g = grad(x), torch.zeros_like(x), torch.zeros_like(x)
    x_prev, x = x, descend(x, h, w @ h, v, gamma, eta)  # init: X^1 = X^0 - eta V^0, H^1 = C(X^1)
    h = h + c(x - h)
    for _ in range(steps):
        v_new = track_gradient(v, g, w @ g, grad(x), grad(x_prev), gamma)
        g_new = g + c(v_new - g)
        x_new = descend(x, h, w @ h, v_new, gamma, eta)
        if check is not None:
            check(dict(x=x, v=v_new, g=g, h=h, x_new=x_new, g_new=g_new, w=w, grad=grad))
        h = h + c(x_new - h)
        x_prev, x, v, g = x, x_new, v_new, g_new
    return (x - x_star).abs().max().item()


def _dpsgd(eta, steps=3000):
    a, b, x_star = _problem()
    w, x = _ring(N), torch.zeros(N, D, dtype=torch.float64)
    for _ in range(steps):
        x = w @ x - eta * a[:, None] * (x - b)
    return (x - x_star).abs().max().item()


def test_identity_compression_with_gamma_1_is_gradient_tracking_and_reaches_the_optimum():
    def check(s):
        w = s["w"]
        # C = id: H = X and G = V (up to rounding: h + (x - h))
        assert torch.allclose(s["h"], s["x"], atol=1e-12, rtol=0)
        assert torch.allclose(s["g_new"], s["v"], atol=1e-12, rtol=0)
        # DIGing: X^{t+1} = W X^t - eta V^t
        assert torch.allclose(s["x_new"], w @ s["x"] - 0.1 * s["v"], atol=1e-12, rtol=0)

    assert _beer(build_compressor("identity"), gamma=1.0, eta=0.1, steps=600, check=check) < 1e-12


def test_top_k_beer_is_exact_where_dpsgd_with_a_constant_step_keeps_a_bias():
    top5 = build_compressor("top_k", ratio=0.25)  # top-5 of 20 (the notes' check: error 3e-14)
    assert _beer(top5, gamma=0.2, eta=0.02, steps=2500) < 1e-9  # 1e-12 after 3000
    assert _dpsgd(0.1) > 1.0 and _dpsgd(0.01) > 0.1  # D-PSGD stalls at a biased point (2.5 and 0.41)


def test_gsgd_beer_reaches_the_exact_optimum():
    assert _beer(GSGDCodec(bits=9), gamma=0.5, eta=0.1, steps=1500) < 1e-9  # 3e-14 after 2000


@pytest.mark.parametrize("compressor", ["identity", "gsgd", "top_k", "random_k"])
def test_mean_of_v_is_the_mean_gradient_at_every_step_for_any_compressor(compressor):
    codec = build_compressor(compressor, bits=4, ratio=0.2)
    errors = []

    def check(s):
        errors.append((s["v"].mean(0) - s["grad"](s["x"]).mean(0)).abs().max().item())

    _beer(codec, gamma=0.3, eta=0.01, steps=200, check=check)
    assert len(errors) == 200 and max(errors) < 1e-12


def test_gsgd_is_the_papers_random_dithering_on_the_whole_vector():
    x = torch.randn(1000, dtype=torch.float64)
    bits, levels = 5, 16
    out = gsgd(x, bits, torch.Generator().manual_seed(0))
    delta = math.sqrt(1000) / levels
    step = x.norm() / levels / (1 + delta)  # delta > 1: tau = 1 + delta
    ratio = out / step
    assert torch.allclose(ratio, ratio.round(), atol=1e-9)  # on the grid ||x|| k / (2^{b-1} tau)
    assert ((out == 0) | (out.sign() == x.sign())).all()
    base = (levels * x.abs() / x.norm()).floor()
    assert ((ratio.abs().round() - base).abs() <= 1).all()  # floor(. + U[0,1)): rounded down or up
    tiny = torch.full((4,), 1e-12, dtype=torch.float64)
    assert torch.equal(gsgd(tiny, bits), tiny)  # the code returns a vector of norm < 1e-10 as it is
    codec = GSGDCodec(bits=9)
    message = codec.encode({"a": torch.randn(3, 5), "b": torch.randn(7)}, None, sender=0, masked_names=[],
                           generator=torch.Generator().manual_seed(1))
    assert message.value_bytes == math.ceil(22 * 9 / 8) + 4 and message.index_bytes == 0  # b bits + the norm
    assert message.weights["a"].shape == (3, 5)


# -- on the engine ------------------------------------------------------------------------------------
def _run(algorithm, clients=4, rounds=3, **kw):
    dm = FederatedDataModule(dataset="digits", num_clients=clients, batch_size=16, test_samples_per_client=20)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05, weight_decay=kw.pop("weight_decay", 5e-4))
    trainer = FederatedTrainer(algorithm=algorithm, rounds=rounds, logger=False, accelerator="cpu",
                               enable_progress_bar=False, local_epochs=1, **kw)
    trainer.fit(model, dm)
    return trainer


def test_runs_on_digits_and_a_message_costs_what_the_compressor_sends():
    trainer = _run(BEER(num_neighbors=2, topology="ring", gamma=0.1), rounds=3)
    d = sum(p.numel() for p in trainer.module.model.parameters())
    vector = math.ceil(d * 9 / 8) + 4  # gsgd b = 9 of the whole model, plus its norm
    bytes_ = [m["comm/busiest_bytes"] for m in trainer.history]
    # round 0: nothing sent yet; round 1: C(X^1 - H^0) only (G^0 = 0); then C(V - G) and C(X - H)
    assert bytes_ == [0, 2 * vector, 2 * 2 * vector]  # ring: 2 neighbours in and out
    assert trainer.history[-1]["comm/busiest_mask_bytes"] == 0
    assert bytes_[-1] / (2 * 2 * 4 * d) == pytest.approx(9 / 32, rel=1e-3)  # 0.56x one dense model per neighbour
    m = trainer.history[-1]
    assert math.isfinite(m["acc/personal_mean"]) and "acc/consensus_mean" in m
    samples = [trainer.datamodule.client_train_size(k) for k in range(4)]
    assert trainer.history[0]["samples/train"] == sum(min(16, s) for s in samples)  # one minibatch each
    assert trainer.history[1]["samples/train"] == 2 * trainer.history[0]["samples/train"]  # two gradients
    fresh = _run(BEER(gradient_difference="fresh"), rounds=2).history  # one gradient per step
    assert fresh[1]["samples/train"] == fresh[0]["samples/train"] == trainer.history[0]["samples/train"]
    top = _run(BEER(compressor="top_k", ratio=0.1), rounds=2).history[1]
    values = sum(math.ceil(0.1 * p.numel()) for p in trainer.module.model.parameters())
    assert top["comm/busiest_bytes"] == 2 * values * 4 and top["comm/busiest_mask_bytes"] == 2 * values * 4


class Quadratic(BEER):
    """BEER on f_i(x) = a_i/2 ||x - b_i||^2 over the model's parameters (a_i = 1 + i/4, b_i = i): the
    engine's rounds on a problem with exact gradients."""

    def loss(self, ctx, batch):
        a, b = 1 + ctx.node / 4, float(ctx.node)
        return sum(a / 2 * (p - b).pow(2).sum() for p in ctx.module.model.parameters())


@pytest.mark.parametrize("difference", ["same_batch", "fresh"])
def test_on_the_engine_the_mean_of_v_is_the_mean_gradient_after_every_round(difference):
    errors, rounds = [], 6
    kept = "beer/x_prev" if difference == "same_batch" else "beer/grad_prev"

    class Check(Quadratic):
        def publish_fields(self, ctx):  # V^t and X^t of the client that just stepped
            out = super().publish_fields(ctx)
            v, x = ctx.read("beer/v"), ctx.read(kept)  # the task's staged state, committed when it publishes
            self.state[ctx.node] = {n: (v[n].double().clone(), x[n].double().clone()) for n in names}
            if len(self.state) == 4:  # the round's last client: check the round
                for n in names:
                    mean_v = sum(self.state[k][n][0] for k in range(4)) / 4
                    if difference == "same_batch":  # kept: X^t, whose gradient is a_i (X^t - b_i)
                        mean_grad = sum((1 + k / 4) * (self.state[k][n][1] - k) for k in range(4)) / 4
                    else:  # kept: the gradient at X^t itself
                        mean_grad = sum(self.state[k][n][1] for k in range(4)) / 4
                    errors.append((mean_v - mean_grad).abs().max().item())
                self.state = {}
            return out

    algo = Check(num_neighbors=2, gamma=0.5, eta=0.2, compressor="gsgd", bits=6, gradient_difference=difference)
    algo.state = {}
    trainer = FederatedTrainer(algorithm=algo, rounds=rounds, logger=False, accelerator="cpu",
                               enable_progress_bar=False, eval_every=100)
    dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=16, test_samples_per_client=10)
    model = SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05, weight_decay=0.0)
    names = [f"{layer}.{kind}" for layer in ("features.0", "features.2", "classifier.0", "classifier.2")
             for kind in ("weight", "bias")]  # cnn_digits' parameters
    trainer.fit(model, dm)
    assert len(errors) == len(names) * rounds and max(errors) < 1e-5  # float32 model


def test_on_the_engine_identity_compression_keeps_exact_replicas():
    """C = identity: H^{t+1} = X^{t+1} and G^t = V^t after every round (the replicas are the models)."""
    trainer = FederatedTrainer(algorithm=Quadratic(gamma=1.0, eta=0.1, compressor="identity"), rounds=3,
                               logger=False, accelerator="cpu", enable_progress_bar=False, eval_every=100)
    dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=16, test_samples_per_client=10)
    trainer.fit(SparseClassifier(arch="cnn_digits", density=1.0, lr=0.05, weight_decay=0.0), dm)
    store = trainer.store
    for k in range(4):
        x, h = store.published(k)[0], store.read(k, "beer/h")
        v, g = store.read(k, "beer/v"), store.read(k, "beer/g")
        for n in x:
            assert torch.allclose(h[n], x[n], atol=1e-6) and torch.allclose(g[n], v[n], atol=1e-6)
    assert trainer.history[-1]["comm/busiest_bytes"] == 2 * 2 * 4 * sum(t.numel() for t in x.values())


@pytest.mark.parametrize("kwargs, message", [
    ({"topology": "time_varying"}, "BEER needs a fixed graph: topology must be one of ring, full, got 'time_varying'"),
    ({"gamma": 0.0}, "gamma must be a number in \\(0, 1\\], got 0.0"),
    ({"eta": -1.0}, "eta must be a positive number or None"),
    ({"compressor": "sign"}, "unknown compressor 'sign'; allowed: gsgd, top_k, random_k, identity"),
    ({"bits": 1}, "bits must be an integer in \\[2, 32\\], got 1"),
    ({"noise": "laplace"}, "unknown noise 'laplace'; allowed: uniform, normal"),
    ({"compressor": "top_k", "ratio": 2.0}, "ratio must be a number in \\(0, 1\\], got 2.0"),
    ({"num_neighbors": 3}, "a ring needs an even num_neighbors"),
    ({"gradient_difference": "svrg"}, "unknown gradient_difference 'svrg'; allowed: same_batch, fresh"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BEER(**kwargs)
