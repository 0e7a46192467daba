"""Large allocations are estimated before they are made: the memory a process may take (MemAvailable and its
cgroup's headroom), the model and its dense store checked before the data is loaded, statistics in chunks."""

from __future__ import annotations

import pytest
import torch

import lightning_dfl.federation.store.memory as store_memory
from lightning_dfl import host_memory
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.datamodules.datasets import smallest_input
from lightning_dfl.datamodules.transforms import channel_stats
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import DisPFL
from lightning_dfl.models import check_model
from lightning_dfl.module import SparseClassifier

GIB = 1 << 30


def _memory_files(tmp_path, monkeypatch, meminfo_kib, v2=None, v1=None):
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kib} kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", tmp_path / "meminfo")
    pairs = []
    for name, values in (("v2", v2), ("v1", v1)):
        limit, usage = tmp_path / f"{name}.limit", tmp_path / f"{name}.usage"
        if values is not None:
            limit.write_text(f"{values[0]}\n")
            usage.write_text(f"{values[1]}\n")
        pairs.append((limit, usage))
    monkeypatch.setattr(host_memory, "CGROUP_FILES", tuple(pairs))


@pytest.mark.parametrize(("v2", "v1", "expected"), [
    (None, None, 8 * GIB),  # no cgroup files: MemAvailable
    (("max", 123), None, 8 * GIB),  # a v2 cgroup without a limit
    ((2 * GIB, GIB // 2), None, GIB + GIB // 2),  # the limit less the use, below MemAvailable
    ((16 * GIB, GIB), None, 8 * GIB),  # a limit above what the host has: MemAvailable
    ((GIB, 2 * GIB), None, 0),  # over its limit already (reclaimable cache counted): nothing left
    (None, (9223372036854771712, 5), 8 * GIB),  # v1's "no limit"
    (None, (3 * GIB, GIB), 2 * GIB),  # a v1 limit
])
def test_the_memory_a_process_may_take_is_the_least_of_the_host_and_its_cgroup(tmp_path, monkeypatch, v2, v1,
                                                                                 expected):
    _memory_files(tmp_path, monkeypatch, 8 * GIB // 1024, v2, v1)
    assert host_memory.available_bytes() == expected


def test_channel_statistics_in_chunks_equal_one_pass():
    images = torch.randint(0, 256, (37, 3, 5, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    x = images.double() / 255
    mean = x.mean(dim=(0, 2, 3))
    std = x.permute(1, 0, 2, 3).reshape(3, -1).std(dim=1, unbiased=False)
    whole = torch.tensor(channel_stats(images, chunk_values=1 << 27), dtype=torch.float64)  # all at once
    assert torch.allclose(whole, torch.stack([mean, std]), rtol=0, atol=1e-7)  # the images are made float32 first
    for chunk_values in (1, 3 * 5 * 7 * 4):  # one image (at least), four
        chunked = torch.tensor(channel_stats(images, chunk_values=chunk_values), dtype=torch.float64)
        assert torch.allclose(chunked, whole, rtol=0, atol=1e-14)


def test_the_least_input_known_before_loading():
    assert smallest_input("digits") == (1, 8) and smallest_input("cifar10", 64) == (3, 64)
    assert smallest_input("ham10000") == (3, 64)
    assert smallest_input("tiny_imagenet") is None and smallest_input("image_folder") is None  # the files decide
    assert smallest_input("image_folder", 100) == (1, 100)  # gray or colour: one channel at least


@pytest.fixture
def no_data_loading(monkeypatch):
    def setup(self, stage=None):
        raise AssertionError("the data was loaded before the refusal")

    monkeypatch.setattr(FederatedDataModule, "setup", setup)


def _fit(model, **data):
    trainer = FederatedTrainer(algorithm=DisPFL(num_neighbors=2), rounds=1, logger=False, accelerator="cpu",
                               enable_progress_bar=False)
    trainer.fit(model, FederatedDataModule(dataset="digits", num_clients=6, **data))


def test_a_model_too_large_for_the_data_is_refused_before_the_data_is_loaded(no_data_loading):
    with pytest.raises(ValueError, match=r"model 'cnn_digits' with options \{\} and image_size=1024 has "
                                         r"2,147,50\d,\d{3} parameters; allowed: at most 2,147,483,648"):
        _fit(SparseClassifier(arch="cnn_digits"), image_size=1024)


def test_a_dense_store_that_cannot_fit_is_refused_before_the_data_is_loaded(no_data_loading, monkeypatch):
    monkeypatch.setattr(store_memory, "available_bytes", lambda: 8 * GIB)
    parameters = check_model("cnn_digits", 2, 1, 8, hidden=1_000_000)  # two classes: the least the data can give
    with pytest.raises(MemoryError) as refused:
        _fit(SparseClassifier(arch="cnn_digits", model_options={"hidden": 1_000_000}))
    message = str(refused.value)
    assert f"the dense client store of 6 nodes needs at least {host_memory.format_bytes(6 * 8 * parameters)}" \
        in message, message
    assert f"the model's {parameters:,} parameters" in message and "refused before the data is loaded" in message


def test_the_least_estimate_never_refuses_what_the_exact_check_accepts(monkeypatch):
    """Counted at two classes and the least input, the early check is a lower bound of the built model's."""
    model = SparseClassifier(arch="cnn_digits", model_options={"hidden": 64})
    least = model.check_for(FederatedDataModule(dataset="digits", num_clients=6))
    model.build(10, 1, 8)
    assert least < sum(p.numel() for p in model.model.parameters())
    assert SparseClassifier(arch="cnn_digits").check_for(FederatedDataModule(dataset="image_folder",
                                                                             num_clients=6)) is None
