"""PRISAM's BN channel masks: groups, BN-scaling pruning, expansion, masked == exported model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dfl.models import build_model
from lightning_dfl.sparse.channels import (
    ChannelMasks,
    apply_channel_masks_,
    channel_groups,
    channel_scores,
    expand,
    export,
    inflate_state,
    kept_count,
    masked_macs,
    masked_param_count,
)
from lightning_dfl.sparse.flops import profile_flops
from lightning_dfl.sparse.masks import ModelMask

SHAPE = (3, 32, 32)


def _vgg() -> nn.Module:
    return build_model("vgg11", num_classes=10, norm="batch")


def _resnet() -> nn.Module:
    return build_model("resnet20", num_classes=10)


@pytest.fixture(scope="module")
def vgg():
    return _vgg()


@pytest.fixture(scope="module")
def resnet():
    return _resnet()


def _randomize_bn(model: nn.Module, seed: int) -> nn.Module:
    """Random gammas, betas and running statistics, so that masking them is tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.randn(c, generator=g))
                m.bias.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
            elif isinstance(m, (nn.Conv2d, nn.Linear)) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model.eval()


# -- groups --------------------------------------------------------------------------------
def test_vgg_groups(vgg):
    groups = channel_groups(vgg)
    assert [g.size for g in groups] == [64, 128, 256, 256, 512, 512, 512, 512]
    assert sum(g.size for g in groups) == 2752
    assert all(not g.tied for g in groups)
    assert groups[0].producers == ("features.0",) and groups[0].consumers == ("features.4",)
    assert groups[-1].consumers == ("classifier.0",)
    masks = ChannelMasks.ones(vgg)
    assert masks.channel_count == masks.bits == 2752 and masks.nbytes == 344


def test_resnet_groups(resnet):
    groups = channel_groups(resnet)
    tied = [g for g in groups if g.tied]
    internal = [g for g in groups if not g.tied]
    assert len(internal) == 9 and sum(g.size for g in internal) == 336
    assert [g.name for g in tied] == ["layer1.residual", "layer2.residual", "layer3.residual"]
    assert [g.size for g in tied] == [16, 32, 64]
    assert tied[0].norms == ("bn1", "layer1.0.bn2", "layer1.1.bn2", "layer1.2.bn2")
    assert tied[0].consumers == ("layer1.0.conv1", "layer1.1.conv1", "layer1.2.conv1",
                                 "layer2.0.conv1", "layer2.0.downsample.0")
    assert tied[1].norms[0] == "layer2.0.downsample.1" and tied[1].producers[0] == "layer2.0.downsample.0"
    assert tied[2].consumers[-1] == "fc"
    assert ChannelMasks.ones(resnet).channel_count == 448
    # Every BN layer belongs to exactly one group.
    bns = [n for n, m in resnet.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert sorted(n for g in groups for n in g.norms) == sorted(bns)


@pytest.mark.parametrize("build", [
    lambda: build_model("vgg11", num_classes=10),  # GroupNorm
    lambda: build_model("resnet18", num_classes=10, norm="batch"),
    lambda: build_model("resnet20", num_classes=10, norm="group", num_groups=8),
    lambda: build_model("cnn_digits", num_classes=10),
    lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
])
def test_unsupported_architectures(build):
    model = build()
    with pytest.raises(ValueError, match="vgg11.*resnet20"):
        channel_groups(model)
    with pytest.raises(ValueError, match="vgg11.*resnet20"):
        ChannelMasks.from_bn_scaling(model, 0.5)


# -- pruning by BN scaling -----------------------------------------------------------------
@pytest.mark.parametrize("rho", [-0.1, 1.0, 1.5, float("nan"), "0.5", True])
def test_rho_outside_range(vgg, rho):
    with pytest.raises(ValueError, match=r"rho .*\[0, 1\)"):
        ChannelMasks.from_bn_scaling(vgg, rho)
    with pytest.raises(ValueError, match=r"rho .*\[0, 1\)"):
        kept_count(10, rho)


def test_kept_count():
    assert kept_count(64, 0.0) == 64
    assert kept_count(64, 0.5) == 32
    assert kept_count(10, 0.3) == 7 and kept_count(10, 0.7) == 3
    assert kept_count(100, 0.29) == 71  # floor(28.999999999999996) would keep 72
    assert kept_count(16, 0.99) == 1  # at least 1


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.5, 0.7])
def test_kept_per_group(resnet, rho):
    model = _randomize_bn(_resnet(), seed=1)
    masks = ChannelMasks.from_bn_scaling(model, rho)
    for group in channel_groups(model):
        assert masks[group.name].dtype == torch.bool
        assert int(masks[group.name].sum()) == group.size - int(rho * group.size + 1e-9)
    if rho == 0.0:
        assert masks == ChannelMasks.ones(model)


def test_ranking_by_abs_gamma_and_ties(vgg):
    model = _vgg()
    with torch.no_grad():
        bn = model.features[1]
        bn.weight.copy_(torch.linspace(-1, 1, 64))  # |gamma| smallest at the centre
        model.features[5].weight.fill_(0.5)  # all tied: lower indices win
    masks = ChannelMasks.from_bn_scaling(model, 0.5)
    scores = bn.weight.detach().abs()
    kept, dropped = scores[masks["features.1"]], scores[~masks["features.1"]]
    assert kept.min() >= dropped.max()
    assert torch.equal(masks["features.5"], torch.arange(128) < 64)


def test_tied_group_scored_by_mean_abs_gamma():
    model = _randomize_bn(_resnet(), seed=2)
    groups = {g.name: g for g in channel_groups(model)}
    modules = dict(model.named_modules())
    group = groups["layer2.residual"]
    expected = torch.stack([modules[n].weight.detach().abs() for n in group.norms]).mean(0)
    assert torch.allclose(channel_scores(model)["layer2.residual"].float(), expected)
    masks = ChannelMasks.from_bn_scaling(model, 0.5)
    top = torch.argsort(-expected.double(), stable=True)[:16]
    assert torch.equal(masks["layer2.residual"], torch.zeros(32, dtype=torch.bool).index_fill(0, top, True))
    # One mask for the whole stage: every tied BN's expanded mask is the same vector.
    expanded = expand(model, masks)
    for norm in group.norms:
        assert torch.equal(expanded[f"{norm}.weight"], masks["layer2.residual"])


def test_vector_round_trip(resnet):
    masks = ChannelMasks.from_bn_scaling(_randomize_bn(_resnet(), seed=3), 0.3)
    vector = masks.to_vector()
    assert vector.shape == (448,) and vector.dtype == torch.bool
    assert ChannelMasks.from_vector(resnet, vector) == masks
    with pytest.raises(ValueError, match="448 channel bits"):
        ChannelMasks.from_vector(resnet, vector[:-1])


# -- expansion -----------------------------------------------------------------------------
def test_expand_hand_checked(vgg):
    masks = {g.name: torch.ones(g.size, dtype=torch.bool) for g in channel_groups(vgg)}
    masks["features.1"][[0, 2]] = False  # conv0 out / conv1 in
    masks["features.5"][[1]] = False  # conv1 out / conv2 in
    masks["features.26"][[3, 511]] = False  # conv7 out / classifier in
    expanded = expand(vgg, masks)

    # Every channel-touched tensor is present with its tensor's shape; the rest is absent.
    state = vgg.state_dict()
    for name, mask in expanded.items():
        assert mask.dtype == torch.bool and mask.shape == state[name].shape, name
    assert "classifier.0.bias" not in expanded
    assert "features.1.num_batches_tracked" not in expanded
    assert {"features.1.running_mean", "features.1.running_var"} <= set(expanded)
    assert set(expand(vgg, masks, include_buffers=False)) == {n for n, _ in vgg.named_parameters()} - {
        "classifier.0.bias"}

    w0 = expanded["features.0.weight"]  # (64, 3, 3, 3): stem input dense
    assert not w0[0].any() and not w0[2].any() and w0[1].all() and int(w0.sum()) == 62 * 27
    assert torch.equal(expanded["features.0.bias"], masks["features.1"])
    for t in ("weight", "bias", "running_mean", "running_var"):
        assert torch.equal(expanded[f"features.1.{t}"], masks["features.1"])
    w1 = expanded["features.4.weight"]  # (128, 64, 3, 3): out by features.5, in by features.1
    assert not w1[1].any()
    assert not w1[:, 0].any() and not w1[:, 2].any()
    assert w1[0, 1].all() and w1[5, 63].all()
    assert int(w1.sum()) == 127 * 62 * 9
    lin = expanded["classifier.0.weight"]  # (10, 512): in by features.26
    assert lin.shape == (10, 512)
    assert not lin[:, 3].any() and not lin[:, 511].any() and int(lin.sum()) == 10 * 510

    # ModelMask accepts the parameter expansion as is.
    ModelMask(vgg, expand(vgg, masks, include_buffers=False))


def test_expand_rejects_mismatched_masks(vgg):
    masks = dict(ChannelMasks.ones(vgg))
    del masks["features.1"]
    with pytest.raises(ValueError, match="name groups"):
        expand(vgg, masks)
    masks["features.1"] = torch.ones(63, dtype=torch.bool)
    with pytest.raises(ValueError, match="63 bits"):
        expand(vgg, masks)


# -- masked model == exported model --------------------------------------------------------
def _check_export(model: nn.Module, rho: float, seed: int) -> None:
    _randomize_bn(model, seed)
    masks = ChannelMasks.from_bn_scaling(model, rho)
    apply_channel_masks_(model, masks)
    compact = export(model, masks)
    assert not compact.training
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        masked_out, compact_out = model(x), compact(x)
    assert masked_out.abs().max() > 0
    torch.testing.assert_close(compact_out, masked_out, atol=1e-5, rtol=1e-5)
    # Parameter and MAC counts of the compact model equal the masked counts.
    assert sum(p.numel() for p in compact.parameters()) == masked_param_count(model, masks)
    assert profile_flops(compact, SHAPE).forward_macs() == masked_macs(model, masks, SHAPE)
    # The compact model keeps the architecture: its groups are the kept widths, all kept.
    assert [g.size for g in channel_groups(compact)] == [int(m.sum()) for m in masks.values()]
    # Inflating the compact state gives back the masked model.
    full = inflate_state(compact.state_dict(), model, masks)
    for name, tensor in model.state_dict().items():
        assert torch.equal(full[name], tensor), name


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_export_vgg11(rho):
    _check_export(_vgg(), rho, seed=10)


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_export_resnet20(rho):
    _check_export(_resnet(), rho, seed=20)


def test_masked_model_needs_no_reset_of_running_stats():
    """Zeroing the expanded parameters alone (e.g. by ModelMask) already gives the compact model."""
    model = _randomize_bn(_resnet(), seed=5)
    masks = ChannelMasks.from_bn_scaling(model, 0.5)
    ModelMask(model, expand(model, masks, include_buffers=False)).apply_()
    compact = export(model, masks)
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(compact(x), model(x), atol=1e-5, rtol=1e-5)
    # Train mode (batch statistics) agrees as well.
    model.train(), compact.train()
    torch.testing.assert_close(compact(x), model(x), atol=1e-5, rtol=1e-5)


def test_apply_resets_dropped_running_stats():
    model = _randomize_bn(_vgg(), seed=6)
    masks = ChannelMasks.from_bn_scaling(model, 0.5)
    apply_channel_masks_(model, masks)
    bn, keep = model.features[1], masks["features.1"]
    assert (bn.weight[~keep] == 0).all() and (bn.bias[~keep] == 0).all()
    assert (bn.running_mean[~keep] == 0).all() and (bn.running_var[~keep] == 1).all()
    assert (bn.weight[keep] != 0).all()


def test_export_does_not_modify_and_rejects_empty_group(vgg):
    model = _randomize_bn(_vgg(), seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masks = dict(ChannelMasks.from_bn_scaling(model, 0.5))
    export(model, masks)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    masks["features.5"] = torch.zeros(128, dtype=torch.bool)
    with pytest.raises(ValueError, match="keep no channel"):
        export(model, masks)


def test_oracle_vgg11_cifar10_rho_half(vgg):
    masks = ChannelMasks.from_bn_scaling(vgg, 0.5)
    profile = profile_flops(vgg, SHAPE)
    params = masked_param_count(vgg, masks)
    macs = masked_macs(vgg, masks, profile=profile)
    assert params == pytest.approx(2.31e6, rel=0.01) and params == 2_311_562
    assert macs == pytest.approx(38.6e6, rel=0.01) and macs == 38_636_032
    assert profile.forward_macs() == pytest.approx(152.8e6, rel=0.01)  # dense (prisam-notes 12)
    assert masked_param_count(vgg, ChannelMasks.ones(vgg)) == sum(p.numel() for p in vgg.parameters())
