"""ERK / uniform layer densities and random initial masks."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dfl.models import build_model
from lightning_dfl.sparse.erk import active_count, erk_densities, initial_masks, random_masks, uniform_densities
from lightning_dfl.sparse.masks import ModelMask, density, maskable_parameters


@pytest.fixture(scope="module")
def resnet18():
    return build_model("resnet18", 10)


def _shapes(model, exclude=None):
    return {name: tuple(p.shape) for name, p in maskable_parameters(model, exclude=exclude).items()}


def _global(densities, shapes):
    total = sum(math.prod(s) for s in shapes.values())
    return sum(densities[n] * math.prod(s) for n, s in shapes.items()) / total


def test_hand_computed_two_layers():
    shapes = {"a": (10, 10), "b": (100, 100)}  # raw scores 20/100 = 0.2 and 200/10000 = 0.02
    # density 0.1: eps = 1010 / (0.2 * 100 + 0.02 * 10000) = 1010 / 220
    d = erk_densities(shapes, 0.1)
    assert d["a"] == pytest.approx(0.2 * 1010 / 220)
    assert d["b"] == pytest.approx(0.02 * 1010 / 220)
    # density 0.2: "a" would get 0.2 * 2020 / 220 > 1, so it is dense and
    # "b" takes the rest: (2020 - 100) / 10000.
    d = erk_densities(shapes, 0.2)
    assert d == {"a": 1.0, "b": pytest.approx(0.192)}


@pytest.mark.parametrize(
    ("exclude", "layer3", "layer4_first", "layer4_rest"),
    [
        (None, 0.72, 0.54, 0.36),  # default set: the 1x1 shortcut convs are masked too
        (lambda name: "downsample" in name, 0.73, 0.55, 0.365),  # DA-DPFL's set
    ],
)
def test_resnet18_reference_values(resnet18, exclude, layer3, layer4_first, layer4_rest):
    shapes = _shapes(resnet18, exclude)
    d = erk_densities(shapes, 0.5)
    dense = ["conv1.weight", "fc.weight", "layer3.0.conv1.weight"]
    dense += [n for n in shapes if n.startswith(("layer1.", "layer2."))]
    for name in dense:
        assert d[name] == 1.0, name
    for name in ["layer3.0.conv2.weight", "layer3.1.conv1.weight", "layer3.1.conv2.weight"]:
        assert d[name] == pytest.approx(layer3, abs=0.01), name
    assert d["layer4.0.conv1.weight"] == pytest.approx(layer4_first, abs=0.01)
    for name in ["layer4.0.conv2.weight", "layer4.1.conv1.weight", "layer4.1.conv2.weight"]:
        assert d[name] == pytest.approx(layer4_rest, abs=0.01), name
    assert _global(d, shapes) == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("name", ["resnet18", "vgg11", "alexnet", "cnn_digits"])
@pytest.mark.parametrize("target", [0.05, 0.2, 0.5, 0.9])
def test_global_density_is_exact_and_layer_densities_valid(name, target):
    shapes = _shapes(build_model(name, 10))
    d = erk_densities(shapes, target)
    assert list(d) == list(shapes)
    assert all(0.0 < v <= 1.0 for v in d.values())
    assert _global(d, shapes) == pytest.approx(target, rel=1e-12)


def test_density_one_and_power_scale_zero():
    shapes = {"a": (4, 3, 3, 3), "b": (10, 4)}
    assert erk_densities(shapes, 1.0) == {"a": 1.0, "b": 1.0}
    assert erk_densities(shapes, 0.3, erk_power_scale=0.0) == pytest.approx(uniform_densities(shapes, 0.3))
    # A larger power scale sends more of the budget to the small (high-score) layer.
    assert erk_densities(shapes, 0.3, erk_power_scale=2.0)["b"] > erk_densities(shapes, 0.3)["b"]


def test_random_masks_have_exact_counts(resnet18):
    shapes = _shapes(resnet18)
    d = erk_densities(shapes, 0.5)
    masks = random_masks(shapes, d, torch.Generator().manual_seed(0))
    assert list(masks) == list(shapes)
    for name, mask in masks.items():
        assert mask.dtype == torch.bool and tuple(mask.shape) == shapes[name]
        assert int(mask.sum()) == round(d[name] * mask.numel()) == active_count(d[name], mask.numel())
    # Global density is exact up to the rounding of one count per layer.
    total = sum(m.numel() for m in masks.values())
    assert abs(density(masks) - 0.5) * total <= 0.5 * len(masks)


def test_active_count_rounds_halves_up():
    assert active_count(0.5, 3) == 2
    assert active_count(0.25, 10) == 3
    assert active_count(1.0, 7) == 7
    assert active_count(0.0, 7) == 0


def test_random_masks_are_seeded_and_uniform():
    shapes = {"w": (10, 10)}
    draw = lambda seed: random_masks(shapes, {"w": 0.3}, torch.Generator().manual_seed(seed))["w"]
    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))
    gen = torch.Generator().manual_seed(3)
    freq = torch.stack([random_masks(shapes, {"w": 0.3}, gen)["w"] for _ in range(2000)]).float().mean(0)
    assert freq.min() > 0.24 and freq.max() < 0.36  # each position active with probability 0.3


def test_initial_masks_from_module_or_parameters(resnet18):
    from_module = initial_masks(resnet18, 0.5, generator=torch.Generator().manual_seed(5))
    from_params = initial_masks(maskable_parameters(resnet18), 0.5,
                                generator=torch.Generator().manual_seed(5))
    assert from_module.keys() == from_params.keys()
    assert all(torch.equal(from_module[n], from_params[n]) for n in from_module)
    uniform = initial_masks(resnet18, 0.2, "uniform", generator=torch.Generator().manual_seed(5))
    for mask in uniform.values():
        assert int(mask.sum()) == round(0.2 * mask.numel())
    # The masks bind to the model's parameters.
    model = build_model("cnn_digits", 10)
    masks = initial_masks(model, 0.3, generator=torch.Generator().manual_seed(0))
    bound = ModelMask(model, masks).attach()
    assert bound.density() == pytest.approx(0.3, abs=1e-3)
    for name, param in maskable_parameters(model).items():
        assert torch.all(param[~masks[name]] == 0)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_bad_density_is_rejected(bad):
    shapes = {"a": (3, 3)}
    with pytest.raises(ValueError, match=f"density must be in \\(0, 1\\], got {bad}"):
        erk_densities(shapes, bad)
    with pytest.raises(ValueError, match="density must be in"):
        uniform_densities(shapes, bad)
    with pytest.raises(ValueError, match="density must be in"):
        initial_masks({"a": torch.zeros(3, 3)}, bad, generator=torch.Generator())


def test_other_errors():
    gen = torch.Generator()
    with pytest.raises(ValueError, match="shapes is empty"):
        erk_densities({}, 0.5)
    with pytest.raises(ValueError, match="erk_power_scale must be >= 0, got -1"):
        erk_densities({"a": (3, 3)}, 0.5, erk_power_scale=-1)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"erk_power_scale must be >= 0, got {bad}"):
            erk_densities({"a": (3, 3)}, 0.5, erk_power_scale=bad)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        random_masks({"a": (3,), "b": (3,)}, {"a": 0.5, "c": 0.5}, gen)
    with pytest.raises(ValueError, match=r"in \[0, 1\], got \{'a': 1.2\}"):
        random_masks({"a": (3,)}, {"a": 1.2}, gen)
    with pytest.raises(ValueError, match="distribution must be one of .*'gaussian'"):
        initial_masks({"a": torch.zeros(3, 3)}, 0.5, "gaussian", generator=gen)
