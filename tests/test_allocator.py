"""The allocator set-up: freed activation buffers are reused, not faulted in again every batch."""

import platform
import subprocess
import sys

import pytest

from lightning_dfl import allocator
from lightning_dfl.allocator import tune_allocator

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

#: a child process that takes ten training steps of a small CNN (activations of 67 MB, above glibc's largest
#: dynamic mmap threshold of 32 MiB) after a first one, and prints the minor page faults of the ten
_STEPS = """
import resource, sys, torch
from torch import nn
from lightning_dfl.allocator import tune_allocator
if sys.argv[1] == "tuned":
    assert tune_allocator().applied
torch.manual_seed(0)
torch.set_num_threads(1)
net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16 * 16, 10))
x, y = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
def step():
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@glibc_only
def test_freed_activations_are_reused_instead_of_faulted_in_again():
    activation_pages = 256 * 64 * 32 * 32 * 4 // 4096
    untuned, tuned = _faults("system"), _faults("tuned")
    assert untuned > 10 * activation_pages  # each step maps its activations afresh and faults them in
    # at most two of the ten steps' worth: measured 806,607 vs 20,480 on an idle machine; with another job on the
    # cores the tuned count took 32,768-114,689 (a heap that grows in 64 MiB steps) against about 1.1 M untuned
    assert tuned < untuned / 5


@glibc_only
def test_tune_allocator_says_what_it_set():
    setting = tune_allocator()
    assert setting.applied and "mmap threshold 1073741824 B" in setting.reason
    assert allocator.allocator_setting() == setting


@pytest.mark.parametrize("bad", [0, -5, 2**31, 1.5, True, "1g"])
def test_bad_thresholds_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=r"mmap_threshold must be a number of bytes .* got " + repr(bad).replace(".", r"\.")):
        tune_allocator(mmap_threshold=bad)


def test_off_glibc_nothing_is_done(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    setting = tune_allocator()
    assert not setting.applied and "not glibc" in setting.reason


def test_fit_tunes_the_allocator_unless_told_not_to(monkeypatch, tmp_path):
    from lightning_dfl.datamodules import FederatedDataModule
    from lightning_dfl.federation import FederatedTrainer
    from lightning_dfl.federation.algorithms import Local
    from lightning_dfl.federation.trainer import trainer as trainer_module
    from lightning_dfl.module import SparseClassifier

    calls = []
    monkeypatch.setattr(trainer_module, "tune_allocator", lambda: calls.append(1))
    for flag in (True, False):
        dm = FederatedDataModule(dataset="digits", num_clients=2, batch_size=32, test_samples_per_client=10)
        trainer = FederatedTrainer(Local(), rounds=1, local_epochs=1, accelerator="cpu", logger=False,
                                   enable_progress_bar=False, default_root_dir=str(tmp_path), tune_allocator=flag)
        trainer.fit(SparseClassifier("cnn_digits", density=0.5), dm)
    assert calls == [1]
    with pytest.raises(ValueError, match="tune_allocator must be True or False, got 'yes'"):
        FederatedTrainer(Local(), tune_allocator="yes")
