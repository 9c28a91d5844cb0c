"""The CUDA driver (libcuda), reached through ctypes without importing torch: the devices a process of this host
sees, in the order and under the names torch gives them (torch counts and names them through this driver).

A process that only needs those (the command naming its GPU, pytest's controller handing each worker its list) need
not import torch for them, which costs seconds on a fresh GPU machine (docs/speed.md, session 19). `cuInit` creates
no context: nothing here holds GPU memory or changes how a later process uses it.
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
