from dataclasses import asdict

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_dfl.federation.store import DenseClientStore, StateField
from lightning_dfl.sparse.masks import ModelMask, density, maskable_parameters, zero_inactive_


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _half_masks(net):
    g = torch.Generator().manual_seed(0)
    return {n: torch.rand(p.shape, generator=g) < 0.5 for n, p in maskable_parameters(net).items()}


def test_maskable_parameters_are_conv_and_linear_weights():
    assert list(maskable_parameters(_net())) == ["0.weight", "2.weight"]
    assert list(maskable_parameters(_net(), exclude=lambda n: n.startswith("2"))) == ["0.weight"]


class _Remask:
    def __init__(self, mask):
        self.mask = mask

    def on_after_optimizer_step(self, strategy, optimizer):
        self.mask.apply_()


def test_momentum_and_weight_decay_cannot_revive_pruned_weights_under_fabric():
    net = _net()
    masks = _half_masks(net)
    mask = ModelMask(net, masks).attach()
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[_Remask(mask)])
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4))
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 3, (16,))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        for name, p in mask.params.items():  # gradients of inactive weights are zero
            assert (p.grad[~masks[name]] == 0).all()
        opt.step()
        opt.zero_grad()
    for name, p in mask.params.items():
        assert (p[~masks[name]] == 0).all()
        assert not torch.equal(p[masks[name]], before[name][masks[name]])  # active weights did train
    assert mask.density() == pytest.approx(density(masks))


def test_masked_weights_are_plain_zeros():
    t = torch.tensor([-1.5, 2.0, -3.0, 4.0, float("nan")])
    out = zero_inactive_(t, torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]))
    assert out is t
    assert t[:4].tolist() == [-1.5, 0.0, 0.0, 4.0] and t[4].isnan()
    assert not t[:4].signbit()[1:3].any()  # -3.0 masked is +0.0, not -0.0 (a bare product's)
    model = nn.Linear(6, 4)
    mask = ModelMask(model, {"weight": torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) < 0.5}).attach()
    pruned = model.weight[~mask.masks["weight"]]
    assert pruned.eq(0).all() and not pruned.signbit().any()


def test_a_loaded_mask_is_what_the_weights_and_gradients_are_masked_with_next():
    model = nn.Linear(6, 4)
    gen = torch.Generator().manual_seed(1)
    mask = ModelMask(model, {"weight": torch.rand(4, 6, generator=gen) < 0.5}).attach()  # casts cached
    new = ~mask.masks["weight"]
    new[0] = True
    mask.load_({"weight": new}, apply=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model(torch.randn(3, 6)).sum().backward()
    assert torch.equal(model.weight.grad != 0, new)  # the gradient hook masks with the loaded mask
    mask.apply_()
    assert torch.equal(model.weight != 0, new)


def test_dense_gradients_context_unmasks_gradients():
    net = _net()
    masks = _half_masks(net)
    mask = ModelMask(net, masks).attach()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    with mask.dense_gradients():
        nn.functional.cross_entropy(net(x), y).backward()
    assert any((p.grad[~masks[n]] != 0).any() for n, p in mask.params.items())


def test_model_mask_rejects_unknown_names_and_shapes():
    net = _net()
    with pytest.raises(ValueError, match="does not have"):
        ModelMask(net, {"nope.weight": torch.ones(2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="shape"):
        ModelMask(net, {"0.weight": torch.ones(2, dtype=torch.bool)})


def test_client_store_slots_keep_start_of_round_snapshots():
    template = {"w": torch.zeros(3), "b": torch.zeros(1)}
    store = DenseClientStore(template, ["w"], num_nodes=2)
    store.initialize(0, {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([1.0])},
                     {"w": torch.tensor([True, False, True])})
    store.initialize(1, {"w": torch.ones(3), "b": torch.zeros(1)}, None)
    w0, m0 = store.published(0)
    assert torch.equal(w0["w"], torch.tensor([1.0, 0.0, 3.0]))  # initial weights are masked
    assert store.active_values(0) == 2 + 1 and store.active_values(1) == 3 + 1
    store.publish(0, {"w": torch.tensor([5.0, 0.0, 6.0]), "b": torch.tensor([2.0])}, {"w": torch.tensor([True, False, True])})
    assert torch.equal(store.published(0)[0]["w"], torch.tensor([1.0, 0.0, 3.0]))  # snapshot still readable
    assert torch.equal(store.published(0, fresh=True)[0]["w"], torch.tensor([5.0, 0.0, 6.0]))
    with pytest.raises(RuntimeError, match="before it was published"):
        store.published(1, fresh=True)
    with pytest.raises(RuntimeError, match="twice"):
        store.publish(0, {"w": torch.zeros(3), "b": torch.zeros(1)}, None)
    store.end_round()
    assert torch.equal(store.published(0)[0]["w"], torch.tensor([5.0, 0.0, 6.0]))
    weights, masks = store.gather([(0, False), (1, False)])
    assert len(weights["w"]) == 2 and weights["w"][0].shape == (3,) and masks["w"][1].dtype == torch.bool


def test_client_state_is_a_plain_serializable_copy(tmp_path):
    template = {"w": torch.zeros(3), "b": torch.zeros(1)}
    store = DenseClientStore(template, ["w"], num_nodes=1, fields=[StateField("personal_lr")])
    store.initialize(0, {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0])},
                     {"w": torch.tensor([True, False, True])})
    store.write(0, "personal_lr", 0.5)
    state = store.state(0)
    state.weights["w"][0] = 99.0  # a copy: the store is untouched
    assert store.published(0)[0]["w"][0] == 1.0
    torch.save(asdict(state), tmp_path / "client0.pt")
    loaded = torch.load(tmp_path / "client0.pt", weights_only=True)
    assert torch.equal(loaded["mask"]["w"], torch.tensor([True, False, True]))
    assert loaded["extras"] == {"personal_lr": torch.tensor(0.5)} and loaded["weights"]["w"][0] == 99.0
