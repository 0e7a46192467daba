"""Uploads to a device that the host does not wait for (lightning_dfl.transfers.to_device)."""

import pytest
import torch

from lightning_dfl.transfers import ASYNC_DEVICE_TYPES, to_device


def test_to_device_is_tensor_to_where_no_upload_waits():
    t = torch.arange(6).reshape(2, 3)
    assert to_device(t, None) is t and to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t
    meta = to_device(t, "meta")  # any other device: Tensor.to
    assert meta.device.type == "meta" and meta.shape == t.shape and meta.dtype == t.dtype
    assert "cuda" in ASYNC_DEVICE_TYPES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_upload_to_a_gpu_is_queued_from_pinned_memory_and_keeps_its_values():
    source = torch.arange(1 << 20, dtype=torch.float32)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue work, so that a waiting upload would wait for it
        busy = busy @ busy / 4096
    up = to_device(source, "cuda")
    source.zero_()  # the upload was staged before: changing the host tensor now changes nothing
    assert up.device.type == "cuda" and not source.is_pinned()
    assert torch.equal(up.cpu(), torch.arange(1 << 20, dtype=torch.float32))
