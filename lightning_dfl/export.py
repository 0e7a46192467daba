"""Physical export of a client's channel-pruned model (PRISAM) and its CPU inference latency.

:func:`client_model` rebuilds a client's published model from a federation checkpoint;
:func:`export_client` turns it into the physically smaller network
(:func:`~lightning_dfl.sparse.channels.export`) and saves it with ``torch.export`` (a ``.pt2``
file that ``torch.export.load(path).module()`` runs without this package);
:func:`measure_latency` times a model's forward on the CPU (fixed threads, warm-up, median).
``lightning-dfl export CHECKPOINT --client K --out FILE`` does all three.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_dfl.checks import check_int
from lightning_dfl.federation.checkpoint_io import read_state
from lightning_dfl.federation.compact_state import checkpoint_weights
from lightning_dfl.models import build_model
from lightning_dfl.sparse.channels import ChannelMasks, channel_groups, export, masked_macs, masked_param_count
from lightning_dfl.sparse.flops import profile_flops

__all__ = ["ExportReport", "client_model", "export_client", "measure_latency", "zero_channels"]

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
    max_abs_logit_diff: float
    latency_full_ms: float | None = None
    latency_exported_ms: float | None = None

    def table(self) -> str:
        rows = [("", "full", "exported"),
                ("parameters", f"{self.params_full:,}", f"{self.params_exported:,}"),
                ("forward MMACs / sample", f"{self.mmacs_full:.2f}", f"{self.mmacs_exported:.2f}")]
        if self.latency_full_ms is not None:
            rows.append(("CPU latency (ms, median)", f"{self.latency_full_ms:.3f}", f"{self.latency_exported_ms:.3f}"))
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))) for r in rows]
        lines.append(f"max |logit difference| (masked vs exported, eval mode): {self.max_abs_logit_diff:.2e}")
        lines.append(f"written: {self.path} (torch.export.load(path).module())")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)


def export_client(checkpoint: str | Path, client: int, out: str | Path, latency: bool = True, threads: int = 1,
                  batch_size: int = 1) -> ExportReport:
    """Export client ``client``'s model of ``checkpoint`` to ``out`` (``.pt2``); check that its
    eval-mode logits equal the masked model's within 1e-5, count its parameters and MACs, and
    (``latency``) time both models."""
    out = Path(out)
    if out.suffix != ".pt2":
        raise ValueError(f"out must be a .pt2 file (torch.export's format), got {str(out)!r}")
    model, masks, shape = client_model(checkpoint, client)
    small = export(model, masks).eval()
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((model(x) - small(x)).abs().max())
    if diff > 1e-5:
        raise RuntimeError(f"the exported model's logits differ from the masked model's by {diff:.3g} (> 1e-5)")
    profile = profile_flops(model, shape)
    params = sum(p.numel() for p in small.parameters())
    assert params == masked_param_count(model, masks)
    report = ExportReport(str(out), client, sum(p.numel() for p in model.parameters()), params,
                          profile.forward_macs() / 1e6, masked_macs(model, masks, profile=profile) / 1e6, diff)
    if latency:
        report.latency_full_ms = measure_latency(model, shape, batch_size, threads)
        report.latency_exported_ms = measure_latency(small, shape, batch_size, threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(torch.export.export(small, (x[:1],)), str(out))
    return report
