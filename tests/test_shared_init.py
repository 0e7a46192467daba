"""Clients start from one shared dense initialization masked by their own masks (DisPFL Alg. 1 line 2:
w_k = w0 * m_k), read through the public API at the start of round 0."""

import warnings

import pytest
import torch

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DADPFL, DPSGD, DisPFL, FedDST, Local, SubFedAvg
from lightning_dfl.models import build_model
from lightning_dfl.module import SparseClassifier

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")

K = 4

#: name -> (algorithm factory, module density); DisPFL and DA-DPFL draw personal masks, the others share
#: the module's mask (Sub-FedAvg starts dense), so they must hold the same property
ALGORITHMS = {
    "dispfl": (lambda: DisPFL(num_neighbors=2), 0.5),
    "dadpfl": (lambda: DADPFL(num_neighbors=2, max_wait=1), 0.5),
    "dpsgd": (lambda: DPSGD(num_neighbors=2), 0.5),
    "local": (lambda: Local(), 0.5),
    "feddst": (lambda: FedDST(clients_per_round=2), 0.5),
    "subfedavg": (lambda: SubFedAvg(clients_per_round=2), 1.0),
}


class InitialStates(FederatedCallback):
    """Copies every client's state (``trainer.store.state(k)``) when round 0 starts."""

    def __init__(self):
        self.states = None

    def on_federated_round_start(self, trainer, pl_module):
        if trainer.current_round == 0:
            self.states = [trainer.store.state(k) for k in range(trainer.datamodule.num_clients)]


def _initial_states(name, store, seed=2):
    factory, density = ALGORITHMS[name]
    dm = FederatedDataModule(dataset="digits", num_clients=K, batch_size=32, test_samples_per_client=20)
    model = SparseClassifier(arch="cnn_digits", density=density, lr=0.05, seed=seed)
    spy = InitialStates()
    trainer = FederatedTrainer(algorithm=factory(), rounds=1, local_steps=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False, callbacks=[spy], store=store, cpu_threads=1)
    trainer.fit(model, dm)
    assert spy.states is not None
    return spy.states, model


@pytest.mark.parametrize("store", ["dense", "compact"])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_clients_start_from_one_dense_init_masked_by_their_own_masks(name, store):
    states, model = _initial_states(name, store)
    masked = list(states[0].mask)
    assert masked, "the module masks its Conv/Linear weights"
    # the shared dense init w0: the model builder's weights for the module's seed, before any mask
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model.hparams.seed)
        dense = build_model("cnn_digits", num_classes=10, in_channels=1, image_size=8).state_dict()
    for k, state in enumerate(states):
        for n in masked:
            mask = state.mask[n]
            active = state.weights[n][mask]
            zeros = int((active == 0).sum())
            assert zeros == 0, f"client {k}: {zeros} of its {mask.sum()} active {n} weights are 0"
            assert (state.weights[n][~mask] == 0).all(), f"client {k}: {n} is nonzero outside its mask"
            assert torch.equal(state.weights[n], torch.where(mask, dense[n], torch.zeros_like(dense[n]))), \
                f"client {k}: {n} is not w0 * m_k"
        for n, w in state.weights.items():
            if n not in masked:
                assert torch.equal(w, dense[n]), f"client {k}: the unmasked {n} is not w0's"
    for k in range(len(states)):
        for j in range(k + 1, len(states)):
            for n in masked:
                both = states[k].mask[n] & states[j].mask[n]
                assert torch.equal(states[k].weights[n][both], states[j].weights[n][both]), \
                    f"clients {k} and {j} differ on {n} where both masks keep a weight"
    if name in ("dispfl", "dadpfl"):  # personal masks: the clients' masks differ
        assert any(not torch.equal(states[0].mask[n], states[1].mask[n]) for n in masked)


def test_the_standalone_module_keeps_its_own_mask_and_the_dense_init():
    """A built module's weights are zero outside its own mask (it trains at its density in a plain Trainer);
    the dense init that a federation masks with each client's mask is kept beside them."""
    model = SparseClassifier(arch="cnn_digits", num_classes=10, in_channels=1, image_size=8, density=0.3, seed=5)
    dense = model.dense_init()
    assert set(dense) == set(model.mask.masks)
    for n, param in model.mask.params.items():
        mask = model.mask.masks[n]
        assert (param[~mask] == 0).all()
        assert torch.equal(param[mask], dense[n][mask])
        assert (dense[n] != 0).all()
