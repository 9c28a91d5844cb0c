"""The CUDA driver (libcuda), reached through ctypes without importing torch: the devices a process of this host
sees, in the order and under the names torch gives them.

torch's CUDA runtime counts and names its devices through this driver, under CUDA_VISIBLE_DEVICES, so its count and
`torch.cuda.get_device_name(0)` are what `device_names()` returns. A process that only needs those (the command
naming its GPU, pytest's controller handing each worker its list) need not import torch for them: the host's torch
costs the command 4.1 s before anything else starts on a fresh H100 machine (its image keeps no bytecode for it), the
driver about 0.1 s. `cuInit` creates no context: nothing here holds GPU memory or changes how a later process uses it.
"""

from __future__ import annotations

import ctypes

SUCCESS = 0


def load():
    """libcuda, or None on a host without the NVIDIA driver."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def devices(cuda) -> list[ctypes.c_int] | None:
    """The handle of every device the driver `cuda` (from `load`) lets this process see, in CUDA's order; None where
    it does not initialise (no device, a broken driver) or refuses one of them."""
    if cuda is None or cuda.cuInit(0) != SUCCESS:
        return None
    count = ctypes.c_int()
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != SUCCESS:
        return None
    handles = []
    for ordinal in range(count.value):
        device = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != SUCCESS:
            return None
        handles.append(device)
    return handles


def device_names() -> list[str] | None:
    """The name of every device this process sees (CUDA_VISIBLE_DEVICES applied), in CUDA's order; None without a
    driver or where it does not initialise (no device, a broken driver)."""
    cuda = load()
    handles = devices(cuda)
    if handles is None:
        return None
    names = []
    for device in handles:
        name = ctypes.create_string_buffer(256)
        if cuda.cuDeviceGetName(name, len(name), device) != SUCCESS:
            return None
        names.append(name.value.decode(errors="replace"))
    return names
