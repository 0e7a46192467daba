"""FLOPs counting: hand-computed nets, the ResNet18 reference, torch's counter, side effects."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_dfl.models import build_model
from lightning_dfl.sparse.erk import initial_masks
from lightning_dfl.sparse.flops import FlopsProfile, LayerFlops, profile_flops


def _tiny() -> nn.Sequential:
    # 2x6x6 input: conv -> 4x4x4 (16 positions, 72 weights) -> flatten 64 -> linear 5 (320 weights)
    return nn.Sequential(nn.Conv2d(2, 4, kernel_size=3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))


def _torch_flops(model: nn.Module, shape: tuple[int, ...]) -> int:
    model.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, *shape))
    return counter.get_total_flops()


def test_hand_computed_dense_and_masked():
    profile = profile_flops(_tiny(), (2, 6, 6))
    assert profile.layers == {"0.weight": LayerFlops(positions=16, numel=72),
                              "3.weight": LayerFlops(positions=1, numel=320)}
    assert profile.dense_forward_flops() == 2 * (16 * 72 + 320) == 2944
    assert profile.forward_flops() == profile.forward_flops(None) == 2944

    conv_mask = torch.zeros(4, 2, 3, 3, dtype=torch.bool)
    conv_mask.view(-1)[:10] = True
    linear_mask = torch.zeros(5, 64, dtype=torch.bool)
    linear_mask.view(-1)[:7] = True
    masks = {"0.weight": conv_mask, "3.weight": linear_mask}
    assert profile.forward_flops(masks) == 2 * (16 * 10 + 7) == 334
    assert profile.forward_flops({"0.weight": 10, "3.weight": 7}) == 334  # precomputed counts
    assert profile.forward_flops({"0.weight": conv_mask}) == 2 * (16 * 10 + 320)  # linear dense
    assert profile.training_flops(50, masks) == 3 * 50 * 334
    assert profile.training_flops(0) == 0


def test_deferred_flops_are_the_same_hand_computed_values_as_device_tensors():
    """An accelerator's form: active counts as 0-dim tensors in, a 0-dim float64 tensor out, layers without a
    count dense (one multi-tensor product and an int64 sum)."""
    profile = profile_flops(_tiny(), (2, 6, 6))
    counts = {"0.weight": torch.tensor(10), "3.weight": torch.tensor(7)}
    flops = profile.deferred_forward_flops(counts)
    assert flops.dtype == torch.float64 and flops.shape == () and flops.item() == 2 * (16 * 10 + 7) == 334
    assert profile.deferred_forward_flops({"0.weight": torch.tensor(10)}).item() == 2 * (16 * 10 + 320)
    assert profile.deferred_forward_flops({}).item() == 2944
    with pytest.raises(ValueError, match="masks name layers this profile does not count: \\['fc'\\]"):
        profile.deferred_forward_flops({"fc": torch.tensor(1)})


def test_grouped_strided_and_shared_layers():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.grouped = nn.Conv2d(4, 8, kernel_size=3, padding=1, groups=2)  # 8x2x3x3 = 144
            self.strided = nn.Conv2d(8, 8, kernel_size=3, stride=2, padding=1, bias=False)  # 576
            self.shared = nn.Linear(3, 3)  # applied twice, on 3 x 8 rows each time

        def forward(self, x):
            x = self.strided(self.grouped(x))  # 5x5 -> 5x5 -> 3x3
            x = x.reshape(x.shape[0], -1, 3)[:, :24]
            return self.shared(self.shared(x))

    model = Net()
    profile = profile_flops(model, (4, 5, 5))
    assert profile.layers["grouped.weight"] == LayerFlops(positions=25, numel=144)
    assert profile.layers["strided.weight"] == LayerFlops(positions=9, numel=576)
    assert profile.layers["shared.weight"] == LayerFlops(positions=2 * 24, numel=9)
    assert profile.dense_forward_flops() == 2 * (25 * 144 + 9 * 576 + 48 * 9)
    assert profile.dense_forward_flops() == _torch_flops(model, (4, 5, 5))


def test_transposed_conv_uses_each_weight_once_per_input_pixel():
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, kernel_size=3, stride=2, groups=2))  # 4x3x3x3
    profile = profile_flops(model, (4, 5, 5))
    assert profile.layers["0.weight"] == LayerFlops(positions=25, numel=108)
    assert profile.dense_forward_flops() == _torch_flops(model, (4, 5, 5)) == 2 * 25 * 108


def test_unused_layers_count_zero_and_accept_masks():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.unused = nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    profile = profile_flops(Net(), (4,))
    assert profile.layers["unused.weight"] == LayerFlops(positions=0, numel=8)
    assert profile.forward_flops({"unused.weight": torch.ones(2, 4)}) == 2 * 8


NATIVE_SHAPES = {"resnet18": (3, 32, 32), "vgg11": (3, 32, 32), "alexnet": (3, 64, 64),
                 "resnet20": (3, 32, 32), "cnn_cifar": (3, 32, 32), "cnn_ham": (3, 64, 64),
                 "cnn_digits": (1, 8, 8)}


@pytest.mark.parametrize("name", sorted(NATIVE_SHAPES))
def test_dense_count_equals_torch_flop_counter(name):
    model = build_model(name, 10)
    shape = NATIVE_SHAPES[name]
    # torch counts 2 FLOPs per multiply-add of convs and matmuls, biases and norms excluded.
    assert profile_flops(model, shape).dense_forward_flops() == _torch_flops(model, shape)


def test_resnet18_matches_dispfl_reference():
    profile = profile_flops(build_model("resnet18", 10), (3, 32, 32))
    # DisPFL: 0.556 GMAC per 32x32 image; exactly 555,422,720 multiply-adds here.
    assert profile.forward_macs() == 555_422_720
    assert profile.dense_forward_flops() == pytest.approx(2 * 0.556e9, rel=0.01)
    # DisPFL's dense 8.3e12 per client per round = 3 x 2 x 0.556e9 x 5 epochs x 500 samples.
    assert profile.training_flops(5 * 500) == pytest.approx(8.3e12, rel=0.01)
    # Sparse masks cost less, in proportion to the active weights of each layer.
    masks = initial_masks(build_model("resnet18", 10), 0.5, generator=torch.Generator().manual_seed(0))
    sparse = profile.forward_flops(masks)
    assert 0.5 * profile.dense_forward_flops() < sparse < profile.dense_forward_flops()
    counts = {name: int(mask.sum()) for name, mask in masks.items()}
    assert profile.forward_flops(counts) == sparse


def test_profiling_leaves_the_model_untouched():
    model = build_model("resnet18", 10, norm="batch")
    model.train()
    model.layer2.eval()  # a mixed state must come back as it was
    modes = {name: m.training for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    profile_flops(model, (3, 32, 32))
    assert {name: m.training for name, m in model.named_modules()} == modes
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)  # BN running stats included
    assert {n: p.requires_grad for n, p in model.named_parameters()} == requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks for m in model.modules())


def test_profile_is_a_plain_record():
    profile = profile_flops(_tiny(), (2, 6, 6))
    assert isinstance(profile, FlopsProfile) and profile.input_shape == (2, 6, 6)
    rebuilt = FlopsProfile(input_shape=(2, 6, 6), layers=dict(profile.layers))
    assert rebuilt == profile


def test_errors_name_the_bad_value():
    profile = profile_flops(_tiny(), (2, 6, 6))
    with pytest.raises(ValueError, match=r"does not count: \['fc.weight'\]"):
        profile.forward_flops({"fc.weight": torch.ones(5, 64)})
    with pytest.raises(ValueError, match="mask '0.weight' has 10 entries, the weight has 72"):
        profile.forward_flops({"0.weight": torch.ones(10)})
    with pytest.raises(ValueError, match=r"active count for '3.weight' must be in \[0, 320\], got 321"):
        profile.forward_flops({"3.weight": 321})
    with pytest.raises(ValueError, match="num_samples must be >= 0, got -1"):
        profile.training_flops(-1)
    with pytest.raises(ValueError, match=r"input_shape .* got \(3, 0, 32\)"):
        profile_flops(_tiny(), (3, 0, 32))
