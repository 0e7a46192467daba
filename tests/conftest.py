import torch

# The test models are tiny: one intra-op thread is several times faster than many on 2 cores.
torch.set_num_threads(1)


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


@pytest.fixture(scope="module")
def digits_loader():
    """sklearn's digits as flat float features: data for LightningModules that know nothing of us."""
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    return DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))


def plain_trainer(callbacks, **kwargs):
    """A quiet CPU ``lightning.pytorch.Trainer`` with ``callbacks``."""
    return Trainer(callbacks=callbacks, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def _decoded_data_cache(tmp_path_factory):
    """Decoded data sets are cached in the session's temporary folder, never in the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LIGHTNING_DFL_CACHE", str(tmp_path_factory.mktemp("decoded-cache")))
        yield


def _run_folders(cwd: Path) -> set[Path]:
    """The folders under ``cwd/runs`` two levels down (``runs/<algorithm>/version_N``)."""
    runs = cwd / "runs"
    return {p for p in runs.glob("*/*") if p.is_dir()} | {runs} if runs.is_dir() else set()


@pytest.fixture(autouse=True)
def _tests_write_no_run_folder_in_the_checkout():
    """A test writes only into temporary folders: none leaves a run folder in the current directory."""
    cwd = Path.cwd()
    before = _run_folders(cwd)
    yield
    new = sorted(str(p) for p in _run_folders(cwd) - before)
    assert not new, f"the test left run folders in the current directory: {new}"
