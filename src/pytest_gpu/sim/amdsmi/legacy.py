"""The Python side of older ``amdsmi`` releases, for the fake ``libamd_smi.so`` at that version.

The installed ``amdsmi`` package (7.0.2) returns a list of dicts from
``amdsmi_get_gpu_process_list``; older releases did not (ROCm/amdsmi ``py-interface/amdsmi_interface.py``):

- up to rocm-6.1.0 (a43fa3e4 of clr's release; amdsmi tag ``rocm-6.1.0``): a list of
  ``amdsmi_process_handle_t`` (a ``c_uint32``, the pid), and
  ``amdsmi_get_gpu_process_info(processor_handle, process)`` calls the C function of that name
  for the dict;
- rocm-6.1.1: a list of ``amdsmi_proc_info_t`` ctypes structs, and
  ``amdsmi_get_gpu_process_info(processor_handle, process)`` turns one into the dict;
- from rocm-6.1.2: dicts (the installed package's own functions).

:func:`install` puts that release's two functions on the imported package, as
:func:`pytest_gpu.sim.amdsmi.preload` arranges where ``$PYTEST_GPU_SIM_ROCM`` names such a
release; the fake library answers with that release's C ABI (``fake_amdsmi.c``).
"""

from __future__ import annotations

import ctypes
import os
from types import ModuleType
from typing import Any

__all__ = ["VERSION_ENV", "install", "modelled"]

#: The ROCm release the fake AMD libraries model ("6.1.0"); unset: the newest.
VERSION_ENV = "PYTEST_GPU_SIM_ROCM"
MAX_NUM_PROCESSES = 1024  # amdsmi_interface.py's, at every release


def modelled() -> tuple[int, int, int] | None:
    """The release ``$PYTEST_GPU_SIM_ROCM`` names (``None``: the newest); ValueError when it names none."""
    value = os.environ.get(VERSION_ENV, "").strip()
    if not value:
        return None
    parts = value.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{VERSION_ENV}={value!r}: expected a ROCm release such as 6.1.0")
    major, minor, patch = ([int(p) for p in parts] + [0, 0])[:3]
    return major, minor, patch


class _ProcInfo610(ctypes.Structure):
    """rocm-6.1.0's ``amdsmi_proc_info_t`` (amdsmi.h): natural alignment, 672 bytes."""

    class _Engine(ctypes.Structure):
        _fields_ = [("gfx", ctypes.c_uint64), ("enc", ctypes.c_uint64), ("reserved", ctypes.c_uint32 * 12)]

    class _Memory(ctypes.Structure):
        _fields_ = [
            ("gtt_mem", ctypes.c_uint64),
            ("cpu_mem", ctypes.c_uint64),
            ("vram_mem", ctypes.c_uint64),
            ("reserved", ctypes.c_uint32 * 10),
        ]

    _fields_ = [
        ("name", ctypes.c_char * 256),
        ("pid", ctypes.c_uint32),
        ("mem", ctypes.c_uint64),
        ("engine_usage", _Engine),
        ("memory_usage", _Memory),
        ("container_name", ctypes.c_char * 256),
        ("reserved", ctypes.c_uint32 * 4),
    ]


def _as_dict(info: Any) -> dict[str, Any]:
    return {
        "name": info.name.decode("utf-8"),
        "pid": info.pid,
        "mem": info.mem,
        "engine_usage": {"gfx": info.engine_usage.gfx, "enc": info.engine_usage.enc},
        "memory_usage": {
            "gtt_mem": info.memory_usage.gtt_mem,
            "cpu_mem": info.memory_usage.cpu_mem,
            "vram_mem": info.memory_usage.vram_mem,
        },
    }


def install(package: ModuleType, release: tuple[int, int, int]) -> None:
    """Give ``package`` (the imported ``amdsmi``) the process-list functions of ``release``
    (those of 6.1.2 and later are its own: nothing changes)."""
    if release >= (6, 1, 2):
        return
    interface = package.amdsmi_interface
    wrapper = package.amdsmi_wrapper
    lib = wrapper._libraries["libamd_smi.so"]
    check = interface._check_res
    parameter_error = interface.AmdSmiParameterException
    handle_type = wrapper.amdsmi_processor_handle

    if release < (6, 1, 1):
        process_handle = ctypes.c_uint32  # amdsmi_process_handle_t
        c_list = lib.amdsmi_get_gpu_process_list
        c_list.restype = ctypes.c_int
        c_list.argtypes = [handle_type, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(process_handle)]
        c_info = lib.amdsmi_get_gpu_process_info
        c_info.restype = ctypes.c_int
        c_info.argtypes = [handle_type, process_handle, ctypes.POINTER(_ProcInfo610)]

        def process_list(processor_handle: Any) -> list[Any]:
            if not isinstance(processor_handle, handle_type):
                raise parameter_error(processor_handle, handle_type)
            max_processes = ctypes.c_uint32(MAX_NUM_PROCESSES)
            found = (process_handle * max_processes.value)()
            check(c_list(processor_handle, ctypes.byref(max_processes), found))
            return [process_handle(found[x]) for x in range(0, max_processes.value)]

        def process_info(processor_handle: Any, process: Any) -> dict[str, Any]:
            if not isinstance(processor_handle, handle_type):
                raise parameter_error(processor_handle, handle_type)
            if not isinstance(process, process_handle):
                raise parameter_error(process, process_handle)
            info = _ProcInfo610()
            check(c_info(processor_handle, process, ctypes.byref(info)))
            return _as_dict(info)

    else:  # 6.1.1: the C list of structs, returned as they are
        struct = wrapper.amdsmi_proc_info_t

        def process_list(processor_handle: Any) -> list[Any]:
            if not isinstance(processor_handle, handle_type):
                raise parameter_error(processor_handle, handle_type)
            max_processes = ctypes.c_uint32(MAX_NUM_PROCESSES)
            found = (struct * max_processes.value)()
            check(wrapper.amdsmi_get_gpu_process_list(processor_handle, ctypes.byref(max_processes), found))
            return [found[index] for index in range(max_processes.value)]

        def process_info(processor_handle: Any, process: Any) -> dict[str, Any]:
            if not isinstance(processor_handle, handle_type):
                raise parameter_error(processor_handle, handle_type)
            if not isinstance(process, struct):
                raise parameter_error(process, struct)
            return _as_dict(process)

    for module in (package, interface):
        setattr(module, "amdsmi_get_gpu_process_list", process_list)  # noqa: B010 (a module of either type)
        setattr(module, "amdsmi_get_gpu_process_info", process_info)  # noqa: B010
