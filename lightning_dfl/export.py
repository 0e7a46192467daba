"""Physical export of a client's channel-pruned model (PRISAM) and its CPU inference latency.

:func:`client_model` rebuilds a client's published model from a federation checkpoint;
:func:`export_client` turns it into the physically smaller network
(:func:`~lightning_dfl.sparse.channels.export`) and saves it with ``torch.export`` (a ``.pt2``
file that ``torch.export.load(path).module()`` runs without this package) with a dynamic batch
dimension (``torch.export.Dim``), so the saved program runs on batches of any size; the exported
and the saved models are checked against the masked model on random inputs and on the client's
own test images (:func:`client_test_images`, rebuilt from the checkpoint's data settings);
:func:`measure_latency` times a model's forward on the CPU (fixed threads, warm-up, median).
``lightning-dfl export CHECKPOINT --client K --out FILE`` does all three.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_dfl.checks import check_int, check_output_path
from lightning_dfl.federation.store.records import checkpoint_weights
from lightning_dfl.federation.trainer.checkpoint_file import read_state
from lightning_dfl.models import build_model
from lightning_dfl.sparse.channels import ChannelMasks, channel_groups, export, masked_macs, masked_param_count
from lightning_dfl.sparse.flops import profile_flops

__all__ = ["ExportReport", "client_model", "client_test_images", "export_client", "measure_latency", "zero_channels"]

#: the largest |logit difference| accepted between the masked model and the exported (or saved) one
TOLERANCE = 1e-5

#: the PRISAM store field holding each client's channel mask
_CHANNELS_FIELD = "prisam/channels"


def zero_channels(model: nn.Module) -> ChannelMasks:
    """The channels a model still uses: a channel is dropped when every BN of its group has
    ``gamma = beta = 0`` there (its output is then 0 whatever its input), so removing it is exact."""
    modules = dict(model.named_modules())
    return ChannelMasks({g.name: torch.stack([(modules[n].weight != 0) | (modules[n].bias != 0)
                                              for n in g.norms]).any(dim=0).cpu()
                         for g in channel_groups(model)})


def client_model(checkpoint: str | Path, client: int) -> tuple[nn.Module, ChannelMasks, tuple[int, ...]]:
    """Client ``client``'s published model in a federation checkpoint (eval mode, CPU), its channel
    mask (PRISAM's stored one; else :func:`zero_channels`) and one sample's input shape."""
    state = read_state(checkpoint)
    identity = state["identity"]
    num_clients = int(identity["num_clients"])
    check_int("client", client, 0, num_clients - 1)
    arch = identity["model/arch"]
    spec = (int(identity["model/num_classes"]), int(identity["model/in_channels"]), int(identity["model/image_size"]))
    options = identity.get("model/model_options") or {}
    model = build_model(arch, num_classes=spec[0], in_channels=spec[1], image_size=spec[2], **options)
    store = state["store"]
    slot = int(store["slot"][client])
    weights = checkpoint_weights(store, client)  # a dense or a compact store's checkpoint
    bad = next((n for n, t in weights.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise ValueError(f"client {client}'s model in the checkpoint {str(checkpoint)!r} holds a non-finite value (NaN "
                         f"or inf) in parameter {bad!r}: it cannot be exported; export another client or checkpoint")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in weights:
                tensor.copy_(weights[name])
    model.eval()
    try:
        channel_groups(model)
    except ValueError as err:
        raise ValueError(f"cannot export a {arch} model: {err}") from None
    field = store.get("fields", {}).get(_CHANNELS_FIELD)
    if field is not None:
        masks = ChannelMasks.from_vector(model, field[""][slot, client].cpu())
    else:
        masks = zero_channels(model)
    return model, masks, (spec[1], spec[2], spec[2])


def client_test_images(checkpoint: str | Path, client: int, data_root: str | Path | None = None) -> tuple[Tensor, Tensor]:
    """Client ``client``'s personal test set (normalised images, labels) as the run saw it: the data
    module is rebuilt from the checkpoint's data settings (``data/*`` of its identity: data set,
    partition, seed, ...); ``data_root`` replaces the stored root (a run moved elsewhere)."""
    from lightning_dfl.datamodules import FederatedDataModule

    identity = read_state(checkpoint)["identity"]
    check_int("client", client, 0, int(identity["num_clients"]) - 1)
    accepted = set(inspect.signature(FederatedDataModule.__init__).parameters) - {"self", "download", "cache"}
    kwargs = {k[len("data/"):]: v for k, v in identity.items() if k.startswith("data/") and k[len("data/"):] in accepted}
    if data_root is not None:
        kwargs["root"] = str(data_root)
    try:
        datamodule = FederatedDataModule(**kwargs)
        batches = list(datamodule.client_test_batches(client))
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"cannot load client {client}'s test images from the checkpoint's data settings ({err}); "
                         f"give the data's folder (data_root / --data_root), or test_images=False "
                         f"(--test_images false) to check on random inputs only") from err
    return torch.cat([x for x, _ in batches]).cpu(), torch.cat([y for _, y in batches]).cpu()


def measure_latency(model: nn.Module, input_shape: tuple[int, ...], batch_size: int = 1, threads: int = 1,
                    warmup: int = 10, repeats: int = 50) -> float:
    """Median wall time (ms) of one eval-mode forward of ``batch_size`` samples on the CPU with
    ``threads`` intra-op threads, after ``warmup`` untimed forwards."""
    for name, value, low in (("batch_size", batch_size, 1), ("threads", threads, 1), ("warmup", warmup, 0),
                             ("repeats", repeats, 1)):
        check_int(name, value, low)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.randn(batch_size, *input_shape, generator=torch.Generator().manual_seed(0))
    model = model.eval()
    try:
        with torch.inference_mode():
            for _ in range(warmup):
                model(x)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                model(x)
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(times)


@dataclass
class ExportReport:
    """What :func:`export_client` wrote and measured."""

    path: str
    client: int
    params_full: int
    params_exported: int
    mmacs_full: float
    mmacs_exported: float
    #: masked vs exported model, eval mode, on 4 random inputs and (``test_images``) the client's test set
    max_abs_logit_diff: float
    latency_full_ms: float | None = None
    latency_exported_ms: float | None = None
    #: how many of the client's test images the checks ran on (0: random inputs only)
    test_images: int = 0
    #: masked vs exported on the client's test images alone (``None``: not checked)
    max_abs_logit_diff_test: float | None = None
    #: masked model vs the saved ``.pt2`` program, on batches of 1 and of 4 random inputs and of the test images
    max_abs_logit_diff_saved: float | None = None
    #: the batch sizes the saved program was run on
    saved_batch_sizes: tuple[int, ...] = ()

    def table(self) -> str:
        rows = [("", "full", "exported"),
                ("parameters", f"{self.params_full:,}", f"{self.params_exported:,}"),
                ("forward MMACs / sample", f"{self.mmacs_full:.2f}", f"{self.mmacs_exported:.2f}")]
        if self.latency_full_ms is not None:
            rows.append(("CPU latency (ms, median)", f"{self.latency_full_ms:.3f}", f"{self.latency_exported_ms:.3f}"))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))) for r in rows]
        lines.append(f"max |logit difference| (masked vs exported, eval mode): {self.max_abs_logit_diff:.2e}")
        if self.max_abs_logit_diff_test is not None:
            lines.append(f"  on client {self.client}'s {self.test_images} test images: {self.max_abs_logit_diff_test:.2e}")
        if self.max_abs_logit_diff_saved is not None:
            sizes = ", ".join(map(str, self.saved_batch_sizes))
            lines.append(f"max |logit difference| (masked vs the saved .pt2, batches of {sizes}): "
                         f"{self.max_abs_logit_diff_saved:.2e}")
        lines.append(f"written: {self.path} (torch.export.load(path).module(), any batch size)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)


def _max_diff(reference: nn.Module, other: nn.Module, x: Tensor) -> float:
    with torch.no_grad():
        return float((reference(x) - other(x)).abs().max())


def export_client(checkpoint: str | Path, client: int, out: str | Path, latency: bool = True, threads: int = 1,
                  batch_size: int = 1, test_images: bool = True, data_root: str | Path | None = None) -> ExportReport:
    """Export client ``client``'s model of ``checkpoint`` to ``out`` (``.pt2``, a dynamic batch
    dimension); check that the exported model's and the saved program's eval-mode logits equal the
    masked model's within 1e-5 on random inputs and (``test_images``) on the client's own test
    images, the saved program on batches of 1, 4 and the whole test set; count parameters and MACs;
    and (``latency``) time both models."""
    out = Path(out)
    if out.suffix != ".pt2":
        raise ValueError(f"out must be a .pt2 file (torch.export's format), got {str(out)!r}")
    check_output_path("out", out, folder=False)
    model, masks, shape = client_model(checkpoint, client)
    small = export(model, masks).eval()
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(0))
    images = client_test_images(checkpoint, client, data_root)[0] if test_images else None
    diff = _max_diff(model, small, x)
    diff_test = None if images is None else _max_diff(model, small, images)
    worst = max(diff, diff_test or 0.0)
    if worst > TOLERANCE:
        raise RuntimeError(f"the exported model's logits differ from the masked model's by {worst:.3g} (> {TOLERANCE:g})")
    diff = worst
    profile = profile_flops(model, shape)
    params = sum(p.numel() for p in small.parameters())
    assert params == masked_param_count(model, masks)
    report = ExportReport(str(out), client, sum(p.numel() for p in model.parameters()), params,
                          profile.forward_macs() / 1e6, masked_macs(model, masks, profile=profile) / 1e6, diff)
    if latency:
        report.latency_full_ms = measure_latency(model, shape, batch_size, threads)
        report.latency_exported_ms = measure_latency(small, shape, batch_size, threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1)  # traced on 4 samples: a batch of 1 would specialise the size
    torch.export.save(torch.export.export(small, (x,), dynamic_shapes=({0: batch},)), str(out))
    saved = torch.export.load(str(out)).module()
    checks = [x[:1], x] + ([] if images is None else [images[:1], images])
    report.max_abs_logit_diff_saved = max(_max_diff(model, saved, c) for c in checks)
    report.saved_batch_sizes = tuple(sorted({int(c.shape[0]) for c in checks}))
    report.test_images = 0 if images is None else int(images.shape[0])
    report.max_abs_logit_diff_test = diff_test
    if report.max_abs_logit_diff_saved > TOLERANCE:
        raise RuntimeError(f"the saved program's logits differ from the masked model's by "
                           f"{report.max_abs_logit_diff_saved:.3g} (> {TOLERANCE:g})")
    return report
