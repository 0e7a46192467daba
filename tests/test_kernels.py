"""The worker's kernels: memory format of its weights and batches, float32 matmul precision."""

import platform
import warnings

import pytest
import torch
from torch import nn

from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.federation.trainer.kernel_settings import (
    apply_matmul_precision,
    apply_memory_format,
    input_converter,
    resolve_memory_format,
    slow_bfloat16,
)
from lightning_dfl.models import build_model
from lightning_dfl.module import SparseClassifier


def test_auto_lays_out_convolutional_models_channels_last_and_leaves_others():
    cnn = build_model("cnn_cifar", num_classes=10, in_channels=3, image_size=32)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    assert resolve_memory_format("auto", cnn) is torch.channels_last
    assert resolve_memory_format("auto", mlp) is torch.contiguous_format
    assert resolve_memory_format("contiguous", cnn) is torch.contiguous_format
    assert resolve_memory_format("channels_last", mlp) is torch.channels_last


def test_apply_memory_format_keeps_the_parameter_objects():
    cnn = build_model("cnn_cifar", num_classes=10, in_channels=3, image_size=32)
    before = {n: p for n, p in cnn.named_parameters()}
    apply_memory_format(cnn, torch.channels_last)
    conv = cnn.get_parameter(next(n for n, p in before.items() if p.dim() == 4))
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert all(p is before[n] for n, p in cnn.named_parameters())  # masks and optimizers stay bound


def test_the_input_converter_lays_out_images_and_keeps_labels():
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    convert = input_converter(None, torch.channels_last)
    cx, cy = convert((x, y))
    assert cx.is_contiguous(memory_format=torch.channels_last) and torch.equal(cx, x) and cy is y
    assert input_converter(None, torch.contiguous_format) is None
    double = input_converter(lambda batch: (batch[0].double(), batch[1]), torch.channels_last)
    dx, _ = double((x, y))
    assert dx.dtype == torch.float64 and dx.is_contiguous(memory_format=torch.channels_last)
    flat = torch.randn(4, 12)
    assert convert((flat, y))[0] is flat  # only 4-D images change layout


@pytest.mark.parametrize("option, bad", [("memory_format", "nhwc"), ("matmul_precision", "tf32")])
def test_bad_values_are_refused_naming_the_allowed_ones(option, bad):
    with pytest.raises(ValueError, match=f"{option} must be one of .*got '{bad}'"):
        FederatedTrainer(DisPFL(), **{option: bad})


def test_matmul_precision_auto_leaves_a_cpu_run_alone():
    before = torch.get_float32_matmul_precision()
    assert apply_matmul_precision("auto", torch.device("cpu")) is None
    assert torch.get_float32_matmul_precision() == before
    try:
        assert apply_matmul_precision("medium", torch.device("cpu")) == "medium"
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def _fit(tmp_path, memory_format):
    dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=32, test_samples_per_client=40)
    trainer = FederatedTrainer(DisPFL(num_neighbors=2), rounds=3, local_epochs=1, accelerator="cpu", logger=False,
                               enable_progress_bar=False, default_root_dir=str(tmp_path), seed=1,
                               memory_format=memory_format)
    model = SparseClassifier("cnn_digits", density=0.5, seed=1)
    trainer.fit(model, dm)
    return trainer, model


def test_a_channels_last_run_trains_as_the_contiguous_one_up_to_rounding(tmp_path):
    last, model = _fit(tmp_path / "cl", "auto")
    plain, _ = _fit(tmp_path / "nchw", "contiguous")
    conv = next(p for p in model.model.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert last.history[-1]["acc/personal_mean"] > 0.5  # learns (10 classes)
    for a, b in zip(last.history, plain.history):
        assert abs(a["acc/personal_mean"] - b["acc/personal_mean"]) <= 0.05
        assert a["density/mean"] == b["density/mean"]
    weights = [last.store.state(k).weights for k in range(4)], [plain.store.state(k).weights for k in range(4)]
    for mine, theirs in zip(*weights):
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-3, atol=1e-3)


def test_benchmark_sets_cudnns_search_for_the_run_and_none_leaves_it(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # restored after the test
    dm = FederatedDataModule(dataset="digits", num_clients=3, batch_size=32, test_samples_per_client=20)
    model = SparseClassifier("cnn_digits", density=0.5, seed=1)
    left = FederatedTrainer(DisPFL(num_neighbors=2), rounds=1, local_epochs=1, accelerator="cpu", logger=False,
                            enable_progress_bar=False, default_root_dir=str(tmp_path / "none"))
    left.fit(model, dm)
    assert torch.backends.cudnn.benchmark is False and "benchmark" not in left.federation.spec.result_settings
    on = FederatedTrainer(DisPFL(num_neighbors=2), rounds=1, local_epochs=1, accelerator="cpu", logger=False,
                          enable_progress_bar=False, default_root_dir=str(tmp_path / "on"), benchmark=True)
    on.fit(SparseClassifier("cnn_digits", density=0.5, seed=1), dm)
    assert torch.backends.cudnn.benchmark is True
    assert on.federation.spec.result_settings["benchmark"] is True  # in the checkpoint's identity: it may change rounding
    assert on.history[0]["acc/personal_mean"] == left.history[0]["acc/personal_mean"]  # no cuDNN on a CPU


@pytest.mark.parametrize("bad", ["yes", 1, "auto"])
def test_a_bad_benchmark_is_refused(bad):
    with pytest.raises(ValueError, match=f"benchmark must be true, false or null .*got {bad!r}"):
        FederatedTrainer(DisPFL(), benchmark=bad)


def _cpu(monkeypatch, machine: str, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


def test_bfloat16_on_an_x86_cpu_without_its_instructions_is_flagged(monkeypatch):
    cpu = torch.device("cpu")
    _cpu(monkeypatch, "x86_64", avx512_bf16=False, amx=False)
    for precision in ("bf16-mixed", "bf16-true"):
        message = slow_bfloat16(precision, cpu)
        assert f"precision {precision!r}" in message and "avx512_bf16 or AMX" in message and "'32-true'" in message
    assert slow_bfloat16("32-true", cpu) is None and slow_bfloat16("64-true", cpu) is None
    assert slow_bfloat16("bf16-mixed", torch.device("cuda")) is None  # a GPU has its own bf16 units
    _cpu(monkeypatch, "x86_64", avx512_bf16=True, amx=False)
    assert slow_bfloat16("bf16-mixed", cpu) is None
    _cpu(monkeypatch, "x86_64", avx512_bf16=False, amx=True)
    assert slow_bfloat16("bf16-mixed", cpu) is None
    _cpu(monkeypatch, "aarch64", avx512_bf16=False, amx=False)  # no x86 detector speaks for it: nothing said
    assert slow_bfloat16("bf16-mixed", cpu) is None


@pytest.mark.parametrize("precision, warned", [("bf16-mixed", True), ("32-true", False)])
def test_a_run_in_bfloat16_on_such_a_cpu_warns_before_training(tmp_path, monkeypatch, precision, warned):
    _cpu(monkeypatch, "x86_64", avx512_bf16=False, amx=False)
    dm = FederatedDataModule(dataset="digits", num_clients=3, batch_size=32, test_samples_per_client=20)
    trainer = FederatedTrainer(DisPFL(num_neighbors=2), rounds=1, local_epochs=1, accelerator="cpu", logger=False,
                               enable_progress_bar=False, default_root_dir=str(tmp_path), precision=precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def said() -> int:
            return sum("no bfloat16 instructions" in str(w.message) for w in caught)

        before_round = []  # the warnings given when the first round starts
        trainer.run_round = lambda i, run=trainer.run_round: before_round.append(said()) or run(i)
        trainer.fit(SparseClassifier("cnn_digits", density=0.5, seed=1), dm)
    assert before_round == [int(warned)] and said() == int(warned)
