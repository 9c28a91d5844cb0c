"""How the run's processes wait for a GPU (stackcheck.process.gpu_wait): each visible device's primary context set to block,
by the worker among several and by what it starts, and nothing where the user keeps CUDA's spinning or there is no
driver. A stand-in for the CUDA driver's calls records what the module asks of it (this machine has none). The same
stand-in names the devices for the command and pytest's controller (stackcheck.process.cuda_driver), which import no torch."""

import ctypes

import pytest

from stackcheck.process import cuda_driver, gpu_wait
from stackcheck.runner import envs
from stackcheck.child import setup as plugin
from stackcheck.core.versions import UsageError


class Driver:
    """libcuda's cuInit, cuDeviceGetCount, cuDeviceGet and cuDevicePrimaryCtxSetFlags_v2, recording the flags set."""

    def __init__(self, devices: int):
        self.devices, self.flags = devices, {}

    def cuInit(self, flags):
        return 0

    def cuDeviceGetCount(self, count):
        ctypes.cast(count, ctypes.POINTER(ctypes.c_int)).contents.value = self.devices
        return 0

    def cuDeviceGet(self, device, ordinal):
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int)).contents.value = 100 + ordinal
        return 0

    def cuDevicePrimaryCtxSetFlags_v2(self, device, flags):
        self.flags[device.value] = flags
        return 0

    def cuDeviceGetName(self, name, length, device):
        ctypes.memmove(name, f"GPU {device.value}".encode() + b"\0", min(length, 16))
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = Driver(devices=2)
    monkeypatch.setattr(cuda_driver, "load", lambda: fake)
    monkeypatch.setenv(gpu_wait.WAIT_VARIABLE, "")  # restored after the test, whatever the module sets
    monkeypatch.delenv(gpu_wait.WAIT_VARIABLE)
    return fake


def test_a_worker_among_several_blocks_on_every_device_and_its_processes_follow(driver, monkeypatch):
    assert gpu_wait.for_a_shared_host() == 2
    assert driver.flags == {100: gpu_wait.CU_CTX_SCHED_BLOCKING_SYNC, 101: gpu_wait.CU_CTX_SCHED_BLOCKING_SYNC}
    assert gpu_wait.os.environ[gpu_wait.WAIT_VARIABLE] == gpu_wait.BLOCK
    driver.flags.clear()
    assert gpu_wait.follow_the_worker() == 2 and len(driver.flags) == 2


def test_spin_kept_where_asked_and_a_lone_process_follows_no_worker(driver, monkeypatch):
    assert gpu_wait.follow_the_worker() == 0  # no worker said so
    monkeypatch.setenv(gpu_wait.WAIT_VARIABLE, gpu_wait.SPIN)
    assert gpu_wait.for_a_shared_host() == 0
    assert gpu_wait.follow_the_worker() == 0
    assert driver.flags == {}


def test_no_driver_no_device(monkeypatch):
    monkeypatch.setattr(cuda_driver, "load", lambda: None)
    assert gpu_wait.block_waits() == 0
    monkeypatch.setattr(cuda_driver, "load", lambda: Driver(devices=0))
    assert gpu_wait.block_waits() == 0


def test_the_devices_are_named_by_the_driver_as_torch_names_them(monkeypatch):
    monkeypatch.setattr(cuda_driver, "load", lambda: Driver(devices=2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_driver.device_names() == ["GPU 100", "GPU 101"]
    assert plugin.visible_gpus() == ["0", "1"]  # the controller's count for its workers' lists
    monkeypatch.setattr(envs.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(envs.metadata, "version", lambda name: "2.11.0+cu130")
    assert envs.cuda_device() == "GPU 100"


def test_no_device_or_a_cpu_torch_is_one_usage_line(monkeypatch):
    monkeypatch.setattr(envs.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(envs.metadata, "version", lambda name: "2.11.0")
    for driver in (None, Driver(devices=0)):
        monkeypatch.setattr(cuda_driver, "load", lambda driver=driver: driver)
        assert cuda_driver.device_names() in (None, [])
        with pytest.raises(UsageError, match="no GPU: torch 2.11.0 on this host sees no CUDA device"):
            envs.cuda_device()
    monkeypatch.setattr(cuda_driver, "load", lambda: Driver(devices=1))
    monkeypatch.setattr(envs.metadata, "version", lambda name: "2.13.0+cpu")
    with pytest.raises(UsageError, match="built for the CPU alone"):
        envs.cuda_device()
