"""Model builders: shapes, the published architectures' sizes and layouts, errors."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from lightning_dfl.models import MODELS, available_models, build_model, model_options

# name -> (in_channels, image_size) of the setting each model is published for.
NATIVE = {
    "resnet18": (3, 32),
    "vgg11": (3, 32),
    "alexnet": (3, 64),
    "resnet20": (3, 32),
    "cnn_cifar": (3, 32),
    "cnn_ham": (3, 64),
    "cnn_digits": (1, 8),
}


def _count(model: nn.Module, kind: type[nn.Module]) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


def test_registry_lists_every_model():
    assert available_models() == sorted(NATIVE)
    assert set(MODELS) == set(NATIVE)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_output_shape_at_native_size_and_defaults(name):
    channels, size = NATIVE[name]
    model = build_model(name, num_classes=7)  # in_channels / image_size default to the native ones
    assert model(torch.randn(2, channels, size, size)).shape == (2, 7)


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_in_channels_and_other_sizes(name):
    _, size = NATIVE[name]
    model = build_model(name, num_classes=3, in_channels=1, image_size=2 * size)
    assert model(torch.randn(2, 1, 2 * size, 2 * size)).shape == (2, 3)


def test_resnet18_is_the_cifar_form_of_dispfl():
    model = build_model("resnet18", 10)
    # DisPFL's customized_resnet18(class_num=10) has exactly this many parameters.
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    assert model.fc.in_features == 512 and model.fc.out_features == 10
    # 20 convs: stem, 16 in blocks, 3 1x1 shortcuts.
    assert _count(model, nn.Conv2d) == 20
    assert sum(1 for n, _ in model.named_modules() if n.endswith("downsample.0")) == 3


@pytest.mark.parametrize("name", ["resnet18", "vgg11"])
def test_group_norm_by_default_batch_norm_on_request(name):
    gn = build_model(name, 10)
    assert _count(gn, nn.GroupNorm) > 0
    assert _count(gn, nn.modules.batchnorm._BatchNorm) == 0
    assert all(m.num_groups == 32 for m in gn.modules() if isinstance(m, nn.GroupNorm))
    bn = build_model(name, 10, norm="batch")
    assert _count(bn, nn.GroupNorm) == 0
    assert _count(bn, nn.BatchNorm2d) == _count(gn, nn.GroupNorm)
    # The norm kind does not change the maskable weights.
    assert sum(p.numel() for p in gn.parameters()) == sum(p.numel() for p in bn.parameters())


def test_vgg11_layout_is_the_authors():
    model = build_model("vgg11", 100)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 128, 256, 256, 512, 512, 512, 512]
    assert all(c.bias is not None for c in convs)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(512, 100)]
    assert _count(model, nn.MaxPool2d) == 5
    # 2752 normalized channels: PRISAM's "around 2700 bits" BN mask of VGG11.
    bn = build_model("vgg11", 100, norm="batch")
    assert sum(m.num_features for m in bn.modules() if isinstance(m, nn.BatchNorm2d)) == 2752


def test_alexnet_layout_is_da_dpfl():
    model = build_model("alexnet", 7)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 192, 384, 256, 256]
    assert convs[0].stride == (2, 2)
    linears = [(l.in_features, l.out_features) for l in model.modules() if isinstance(l, nn.Linear)]
    assert linears == [(1024, 4096), (4096, 4096), (4096, 7)]
    assert _count(model, nn.modules.batchnorm._BatchNorm) + _count(model, nn.GroupNorm) == 0


def test_resnet20_is_the_cifar_depth_20_net_with_batch_norm():
    model = build_model("resnet20", 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) + 1 == 20  # 19 3x3 convs + the classifier
    assert {c.out_channels for c in convs} == {16, 32, 64}
    assert _count(model, nn.BatchNorm2d) == 19 + 2  # one per conv, two 1x1 shortcuts
    assert _count(model, nn.GroupNorm) == 0


def test_psfl_cnns_have_the_described_layers():
    cifar = build_model("cnn_cifar", 10)
    convs = [m for m in cifar.modules() if isinstance(m, nn.Conv2d)]
    assert [c.kernel_size for c in convs] == [(5, 5), (5, 5)]
    assert _count(cifar, nn.Linear) == 3
    ham = build_model("cnn_ham", 7)
    convs = [m for m in ham.modules() if isinstance(m, nn.Conv2d)]
    assert [c.kernel_size for c in convs] == [(3, 3)] * 3
    assert _count(ham, nn.Linear) == 2 and _count(ham, nn.Dropout) == 2


def test_models_pickle_for_checkpoints():
    for name in ("resnet18", "vgg11", "resnet20"):
        model = build_model(name, 10)
        clone = pickle.loads(pickle.dumps(model))
        x = torch.randn(2, 3, 32, 32)
        model.eval(), clone.eval()
        torch.testing.assert_close(model(x), clone(x))


@pytest.fixture
def one_thread():
    # Tiny ops: one intra-op thread is ~25x faster than two on a loaded 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_cnn_digits_learns_the_embedded_digits_quickly(one_thread):
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=gen)
    train, test = order[:1400], order[1400:]
    torch.manual_seed(0)
    model = build_model("cnn_digits", 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=5e-4)  # the project's plain SGD
    for _ in range(3):
        for batch in train[torch.randperm(len(train), generator=gen)].split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    assert accuracy > 0.85  # chance is 0.1


def test_model_options_lists_keyword_options():
    assert model_options("resnet18") == {"norm": "group", "num_groups": 32}
    assert model_options("cnn_cifar") == {}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: build_model("resnet50", 10), r"unknown model 'resnet50'.*resnet18"),
        (lambda: build_model("resnet18", 1), "num_classes.*>= 2, got 1"),
        (lambda: build_model("resnet18", 10, in_channels=0), "in_channels.*got 0"),
        (lambda: build_model("resnet18", 10, image_size=0), "image_size.*got 0"),
        (lambda: build_model("vgg11", 10, image_size=16), "vgg11 needs image_size >= 32.*got 16"),
        (lambda: build_model("alexnet", 7, image_size=8), "alexnet needs image_size >= 16.*got 8"),
        (lambda: build_model("cnn_cifar", 10, image_size=12), "cnn_cifar needs image_size >= 16"),
        (lambda: build_model("resnet18", 10, norm="layer"), "norm must be one of.*'layer'"),
        (lambda: build_model("resnet18", 10, num_groups=5), "num_groups=5 must divide"),
        (lambda: build_model("alexnet", 7, dropout=1.0), "dropout.*got 1.0"),
    ],
)
def test_builder_errors_name_the_bad_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match=r"no option\(s\) \['depth'\]"):
        build_model("resnet18", 10, depth=34)
