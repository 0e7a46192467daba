"""Physical export of a client's channel-pruned model from a checkpoint, and its latency."""

import warnings

import pytest
import torch

from lightning_dfl.cli import main
from lightning_dfl.datamodules import FederatedDataModule
from lightning_dfl.export import client_model, client_test_images, export_client, measure_latency, zero_channels
from lightning_dfl.federation import FederatedTrainer
from lightning_dfl.federation.algorithms import PRISAM, Local
from lightning_dfl.federation.algorithms.prisam import CHANNELS_FIELD
from lightning_dfl.models import build_model
from lightning_dfl.module import SparseClassifier
from lightning_dfl.sparse.channels import ChannelMasks, apply_channel_masks_, masked_param_count

warnings.filterwarnings("ignore", message=".*deviate from their training label proportions.*")


def _run(tmp_path, algorithm, arch="resnet20"):
    trainer = FederatedTrainer(algorithm=algorithm, rounds=2, local_steps=2, logger=False,
                               accelerator="cpu", enable_progress_bar=False, checkpoint_every=2,
                               default_root_dir=str(tmp_path))
    dm = FederatedDataModule(dataset="digits", num_clients=4, batch_size=16, test_samples_per_client=20)
    trainer.fit(SparseClassifier(arch=arch, density=1.0, lr=0.05), dm)
    return trainer


@pytest.fixture(scope="module")
def prisam_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("prisam"), PRISAM(ratio=0.5, num_groups=2, warmup_rounds=1))


def test_the_exported_file_runs_the_clients_model_physically_smaller(prisam_run, tmp_path):
    trainer = prisam_run
    report = export_client(trainer.checkpoint_path, 2, tmp_path / "c2.pt2", latency=False)
    model, masks, shape = client_model(trainer.checkpoint_path, 2)
    assert shape == (1, 8, 8)
    assert masks == ChannelMasks.from_vector(model, trainer.store.read(2, CHANNELS_FIELD))
    assert report.params_exported == masked_param_count(model, masks) < 0.3 * report.params_full
    assert report.max_abs_logit_diff <= 1e-5
    loaded = torch.export.load(str(tmp_path / "c2.pt2")).module()
    x = torch.randn(1, *shape)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x), atol=1e-5)


def test_the_saved_program_runs_any_batch_of_the_clients_test_images(prisam_run, tmp_path):
    """The .pt2 is exported with a dynamic batch dimension (torch.export.Dim): its module() runs batches
    of 1 and of 4+ (a batch-of-one trace failed on 4: "Guard failed: x.size()[0] == 1"), and equals the
    masked model on the client's own test images, not only on random inputs."""
    report = export_client(prisam_run.checkpoint_path, 3, tmp_path / "c3.pt2", latency=False)
    model, _, _ = client_model(prisam_run.checkpoint_path, 3)
    images, labels = client_test_images(prisam_run.checkpoint_path, 3)
    expected = prisam_run.datamodule.client_test_batches(3)
    assert torch.equal(images, torch.cat([x for x, _ in expected]).cpu())  # the run's own test set
    assert images.shape[0] == report.test_images == 20 and report.max_abs_logit_diff_test <= 1e-5
    assert report.max_abs_logit_diff_saved <= 1e-5 and {1, 4, 20} <= set(report.saved_batch_sizes)
    loaded = torch.export.load(str(tmp_path / "c3.pt2")).module()
    with torch.no_grad():
        for batch in (images[:1], images[:4], images[:7], images):
            assert torch.allclose(loaded(batch), model(batch), atol=1e-5)


def test_export_command_prints_sizes_macs_and_latency(prisam_run, tmp_path, capsys):
    main(["export", str(prisam_run.checkpoint_path), "--client", "1", "--out", str(tmp_path / "c1.pt2")])
    out = capsys.readouterr().out
    assert "parameters" in out and "forward MMACs / sample" in out and "CPU latency (ms, median)" in out
    assert "on client 1's 20 test images" in out and "the saved .pt2, batches of 1, 4, 20" in out
    assert (tmp_path / "c1.pt2").is_file()


def test_bad_requests_are_refused(prisam_run, tmp_path):
    with pytest.raises(ValueError, match="client must be an integer in \\[0, 3\\], got 4"):
        export_client(prisam_run.checkpoint_path, 4, tmp_path / "x.pt2")
    with pytest.raises(ValueError, match="out must be a .pt2 file"):
        export_client(prisam_run.checkpoint_path, 0, tmp_path / "x.onnx")


def test_a_model_without_channel_groups_is_refused(tmp_path):
    trainer = _run(tmp_path, Local(), arch="cnn_digits")
    with pytest.raises(ValueError, match="cannot export a cnn_digits model"):
        export_client(trainer.checkpoint_path, 0, tmp_path / "x.pt2")


def test_zero_channels_finds_exactly_the_channels_whose_bn_outputs_are_zero():
    model = build_model("resnet20", num_classes=10)
    assert zero_channels(model) == ChannelMasks.ones(model)
    masks = ChannelMasks.from_bn_scaling(model, 0.5)
    apply_channel_masks_(model, masks)
    assert zero_channels(model) == masks


def test_latency_is_a_positive_median_and_threads_are_restored():
    before = torch.get_num_threads()
    assert measure_latency(torch.nn.Linear(4, 2), (4,), threads=1, warmup=1, repeats=3) > 0
    assert torch.get_num_threads() == before
