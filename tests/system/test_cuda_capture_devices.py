"""The Python side's CUDA-graph capture refusal looks at the current stream of every device
the tensors live on, not only the current device's (issue 37 item 6). CPU-only: PyTorch's
device and capture queries are stood in for, as a GPU with two devices would answer them."""

import contextlib

import pytest
import torch

from flashwrite.system import cuda as fw_cuda


@pytest.fixture
def two_gpus_capturing_on_1(monkeypatch):
    state = {"current": 0}

    @contextlib.contextmanager
    def device(d):
        before, state["current"] = state["current"], d
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["current"] == 1)
    return state


def test_capture_on_another_device_than_the_current_is_refused(two_gpus_capturing_on_1):
    with pytest.raises(RuntimeError, match=r"current stream of cuda:1 is being captured"):
        fw_cuda.refuse_capture("a save of GPU tensors", {1})
    assert two_gpus_capturing_on_1["current"] == 0  # the current device is left as it was


def test_no_capture_on_the_tensors_devices_is_not_refused(two_gpus_capturing_on_1):
    fw_cuda.refuse_capture("a save of GPU tensors", {0})
