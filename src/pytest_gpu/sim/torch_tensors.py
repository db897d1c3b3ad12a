"""Tensors on a simulated GPU, for torch's CPU build.

:func:`install` (which :func:`pytest_gpu.sim.torch_cuda.install` calls) lets code written
for CUDA put tensors on the simulated GPUs: ``torch.ones(n, device="cuda")``,
``torch.randn(..., device=gpu.device)``, ``x.to("cuda:1")``, ``x.cuda()``,
``model.to("cuda")``, and every operation on such tensors, their results included (the
autograd engine's too). Such a tensor is a host tensor (its bytes are in the process's
memory, where the CPU kernels compute) whose storage is charged to its simulated GPU
through the caching allocator of :mod:`pytest_gpu.sim.torch_cuda`, as ``torch_cuda.empty``
is: sizes round up as torch's allocator rounds them, ``set_per_process_memory_fraction``
caps them, the lease's cap and the device's memory end in ``torch.OutOfMemoryError`` with
torch's message, an ordinal this process cannot see raises c10's "invalid device
ordinal", a bare ``"cuda"`` is the current device, ``torch.cuda.memory_allocated`` and
NVML count them, and the bytes go back to torch's cache when the storage is freed (the
last tensor viewing it). Memory is never cheaper than on CUDA: a result that takes a new
buffer there takes one here; views share their base's.

How: a tensor on a simulated GPU is an instance of a subclass of ``torch.Tensor`` whose
``__torch_dispatch__`` runs each aten operation on the host and charges the results that
own new storage to the operation's device (the ``device=`` it names, else its inputs'),
and whose ``__torch_function__`` answers what Python asks of a device (``device``,
``is_cuda``, ``get_device``, ``numpy()``, printing). A Python fallback for the CUDA (XPU)
dispatch key serves the factories: what reaches that key was asked for on such a device
(``empty.memory_format`` and ``empty_strided``, which every factory, ``torch.tensor`` and
``_to_copy`` reach, are charged before the host is asked for their bytes). ``Tensor.to``,
``cuda``/``xpu``, ``cpu``, ``new_tensor`` and ``torch.tensor``/``as_tensor``/``asarray``
resolve a bare ``"cuda"`` to the current device (the CPU build's C++ cannot). The charge
lives on the storage's Python object, which torch keeps for as long as the storage lives.
Global: every thread of the process sees it.

What differs from CUDA (what a test on simulated GPUs should not rely on):

- The bytes are in the host's memory: a test that fills a simulated 80 GiB GPU needs that
  much RAM (``torch.empty`` only reserves it; an allocation the GPU refuses never reaches
  the host). An operation's result is computed before it is charged.
- ``type(x)`` is the subclass, not ``torch.Tensor`` (``isinstance`` holds); a parameter
  moved to a simulated GPU is that subclass with torch's ``_is_param`` mark (``isinstance(p,
  nn.Parameter)`` holds), as torch does for tensor subclasses.
- ``x.device`` and ``is_cuda`` answer the simulated GPU, but C++ sees a CPU tensor:
  ``untyped_storage().device`` is ``cpu``, ``data_ptr()`` a host address. Tensors on two
  simulated GPUs in one operation fail as on CUDA; a CPU tensor and a simulated-GPU one mix
  without torch's error (the result is on the simulated GPU). No CUDA kernel, stream,
  cuBLAS workspace, CUDA graph or ``torch.Generator(device="cuda")`` exists (such memory is
  not charged). TorchScript and C++ extensions see host tensors (in them ``.cpu()`` leaves a
  tensor where it is, and a bare ``"cuda"`` fails).
- ``torch.save`` writes such a tensor as a CPU tensor; ``torch.load`` gives it back on the
  CPU (``map_location``/``.to("cuda")`` put it on a simulated GPU).
- Only dense (strided) tensors: sparse and nested ones on "cuda" fail as the CPU build fails.
- An operation on such tensors costs tens of microseconds of Python (docs/simulated.md
  has the figures); operations on host tensors cost what they cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .cuda import hidden_in_tracebacks

__all__ = ["install"]

BLOCK_ATTR = "_pytest_gpu_block"  # the charge, on the storage's Python object


__tracebackhide__ = hidden_in_tracebacks  # an op's error shows the test's line, as torch's (from C++) does


@dataclass
class _State:
    torch: Any = None
    kind: str = "cuda"  # the device type served: "cuda", or "xpu" on a fake Intel machine
    empty: Callable[..., Any] | None = None  # torch_cuda.empty: a charge on a device
    cls: type | None = None
    libraries: dict[str, Any] = field(default_factory=dict)  # dispatch key -> its kernels' Library (kept alive)
    methods: dict[str, Callable[..., Any]] = field(default_factory=dict)  # torch.Tensor's own to, cuda, xpu, cpu
    special: dict[Any, Callable[..., Any]] = field(default_factory=dict)


_state = _State()


def install(torch: ModuleType, kind: str, empty: Callable[..., Any]) -> None:
    """Let ``torch`` (the CPU build) put tensors on the simulated GPUs of type ``kind``
    (``"cuda"``, ``"xpu"``), charged through ``empty(nbytes, device)``
    (:func:`pytest_gpu.sim.torch_cuda.empty`). Idempotent; what it registers lasts as long
    as the process (a later call may switch ``kind``, as a new fake machine in the same process)."""
    if _state.torch is not None and _state.torch is not torch:
        raise RuntimeError("pytest_gpu.sim.torch_tensors: installed for another torch module")
    _state.kind, _state.empty = kind, empty
    key = kind.upper()  # torch's dispatch key for the device type: CUDA, XPU
    if key not in _state.libraries:  # what reaches this key is an op asked for on such a device: a factory
        library = torch.library.Library("_", "IMPL")
        library.fallback(_factory, key)
        _state.libraries[key] = library
    if _state.torch is not None:
        return
    _state.torch = torch
    tensor = torch.Tensor
    _state.cls = type(
        "Tensor",
        (tensor,),
        {
            "__module__": __name__,
            "__qualname__": "Tensor",
            "__torch_dispatch__": classmethod(_torch_dispatch),
            "__torch_function__": classmethod(_torch_function),
        },
    )
    _state.methods = {name: getattr(tensor, name) for name in ("to", "cuda", "xpu", "cpu", "new_tensor")}
    tensor.to, tensor.cpu, tensor.new_tensor = _to, _cpu, _new_tensor
    tensor.cuda, tensor.xpu = _device_method("cuda"), _device_method("xpu")
    builtins = torch.jit._builtins  # TorchScript compiles these by identity: the wrappers are the same ops
    for name in ("tensor", "as_tensor", "asarray"):  # their bindings need the device's index
        _state.methods[name] = original = getattr(torch, name)
        wrapper = _with_index(name)
        setattr(torch, name, wrapper)
        op = builtins._find_builtin(original)
        if op is not None:
            builtins._register_builtin(wrapper, op)
    _state.special = {
        tensor.device.__get__: _device_of_tensor,
        tensor.is_cuda.__get__: lambda self: _is(self, "cuda"),
        tensor.is_xpu.__get__: lambda self: _is(self, "xpu"),
        tensor.is_cpu.__get__: lambda self: _is(self, "cpu"),
        tensor.get_device: _get_device,
        tensor.numpy: _numpy,
        tensor.__array__: _array,
        tensor.__repr__: _repr,
        tensor.__format__: _format,
        tensor.__reduce_ex__: _reduce_ex,
        tensor.tolist: lambda self: _host_alias(self).tolist(),  # refused for subclasses; a copy to the host on CUDA
        torch._has_compatible_shallow_copy_type: _compatible,
    }


# -- the charge: a storage's block of simulated memory ---------------------------------------


def _storage(tensor: Any) -> Any:
    torch = _state.torch
    with torch._C.DisableTorchFunctionSubclass():
        if not torch._C._has_storage(tensor):
            return None
        return tensor.untyped_storage()


def _block(storage: Any) -> Any:
    return None if storage is None else getattr(storage, BLOCK_ATTR, None)


def _ordinal(tensor: Any) -> int | None:
    """The simulated GPU a tensor is on, or None (on the host)."""
    block = _block(_storage(tensor))
    return None if block is None else int(block.device)


def _charge(storage: Any, device: Any) -> None:
    """Charge ``storage``'s bytes to ``device`` (allocated before the old charge, if any, is
    freed: a resized storage needs both for a moment, as cudaMalloc then cudaFree)."""
    assert _state.empty is not None
    setattr(storage, BLOCK_ATTR, _state.empty(int(storage.nbytes()), device))


def _wrap(tensor: Any) -> Any:
    """The subclass's instance for a host tensor whose storage is charged (under ``_DisableTorchDispatch``)."""
    cls = _state.cls
    if type(tensor) is cls:
        return tensor
    return _state.torch.Tensor._make_subclass(cls, tensor, tensor.requires_grad)


# -- factories: the CUDA (XPU) dispatch key ----------------------------------------------------


def _factory(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The CUDA (XPU) key's fallback: an op that reaches it was asked for on a simulated GPU
    by its ``device=`` (every factory: ``empty.memory_format``, ``empty_strided``,
    ``tril_indices``, ...; ``torch.tensor`` and ``_to_copy`` come through ``empty_strided``).
    It runs on the host and its results are charged to that device; ``empty``'s are charged
    first, as torch allocates, so memory the GPU cannot give is not asked of the host."""
    torch = _state.torch
    device = kwargs.get("device")
    if device is None or device.type != _state.kind:
        kind = "a simulated GPU" if device is None else f"{device.type} (pytest-gpu's simulated GPUs are {_state.kind})"
        raise NotImplementedError(f"Could not run '{op}' with arguments from the backend of {kind}.")
    kwargs = {**kwargs, "device": torch.device("cpu")}
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False  # pinned host memory is for copies to a GPU; here there is none
    block = None
    nbytes = _empty_nbytes(op, args, kwargs)
    if nbytes is not None:
        assert _state.empty is not None
        block = _state.empty(nbytes, device)
    with torch._C._DisableTorchDispatch():
        out = op(*args, **kwargs)
        if block is not None and _storage(out).nbytes() == nbytes:
            setattr(_storage(out), BLOCK_ATTR, block)
        return _outputs(out, device, [])


def _empty_nbytes(op: Any, args: Any, kwargs: dict[str, Any]) -> int | None:
    """The bytes ``empty.memory_format`` and ``empty_strided`` make (c10's ``computeStorageNbytes``)."""
    torch = _state.torch
    aten = torch.ops.aten
    if op is aten.empty.memory_format:
        size, stride = list(args[0]), None
    elif op is aten.empty_strided.default:
        size, stride = list(args[0]), list(args[1])
    else:
        return None
    itemsize = int((kwargs.get("dtype") or torch.get_default_dtype()).itemsize)
    if any(int(n) == 0 for n in size):
        return 0
    if stride is None:
        elements = 1
        for n in size:
            elements *= int(n)
        return elements * itemsize
    return (1 + sum((int(n) - 1) * int(st) for n, st in zip(size, stride, strict=True))) * itemsize


# -- operations on tensors on a simulated GPU ---------------------------------------------------


def _tensors(value: Any) -> Iterator[Any]:
    if isinstance(value, _state.torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


_HOST = "host"
# ops that take tensors on two devices (torch's cross-device copies)
_CROSS_DEVICE = frozenset({"copy_", "copy", "_copy_from", "_copy_from_and_resize", "_to_copy", "set_"})


def _torch_dispatch(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Run ``func`` on the host; charge each result that owns new storage to the operation's
    device: the simulated GPU its ``device=`` names, else its inputs' (a ``device=`` that is
    not a simulated GPU: the host). Inputs on two simulated GPUs fail as on CUDA."""
    torch = _state.torch
    kwargs = kwargs or {}
    target: Any = None
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
        target = device if device.type == _state.kind else _HOST
        if target is device:
            kwargs = {**kwargs, "device": torch.device("cpu")}
    with torch._C._DisableTorchDispatch():
        inputs = []
        on: Any = None  # the inputs' simulated GPU
        for tensor in (*_tensors(args), *_tensors(list(kwargs.values()))):
            storage = _storage(tensor)
            inputs.append(storage)
            block = _block(storage)
            if block is None:
                continue
            if on is None:
                on = block.device
            elif block.device != on and func.overloadpacket.__name__ not in _CROSS_DEVICE:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"{_state.kind}:{on} and {_state.kind}:{block.device}!"
                )
        if target is None:
            target = on
        out = func(*args, **kwargs)
        if target is None or target is _HOST:
            return out  # nothing on a simulated GPU: all on the host
        return _outputs(out, target, inputs)


def _outputs(out: Any, target: Any, inputs: list[Any]) -> Any:
    torch = _state.torch
    if isinstance(out, torch.Tensor):
        storage = _storage(out)
        if storage is None:
            return out
        block = _block(storage)
        if block is not None:  # a view, or an input changed in place
            if block.nbytes != storage.nbytes():  # resized: its memory was reallocated
                _charge(storage, block.device)
            return _wrap(out)
        if any(storage is s for s in inputs):
            return out  # an input on the host, written in place (copy_ into it), or a view of one
        _charge(storage, target)
        return _wrap(out)
    if isinstance(out, (list, tuple)):  # an aten op's several results: a plain tuple or list
        results = [_outputs(item, target, inputs) for item in out]
        return results if isinstance(out, list) else tuple(results)
    return out


# -- what Python asks of a device ---------------------------------------------------------------


def _torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    kwargs = kwargs or {}
    special = _state.special.get(func)
    if special is not None:
        return special(*args, **kwargs)
    torch = _state.torch
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    if type(result) is torch.Tensor and _ordinal(result) is not None:
        with torch._C._DisableTorchDispatch():
            return _wrap(result)  # ``.data`` and other aliases made without the dispatcher
    return result


def _is(tensor: Any, kind: str) -> bool:
    """``is_cuda``, ``is_xpu``, ``is_cpu``."""
    if _ordinal(tensor) is not None:
        return kind == _state.kind
    torch = _state.torch
    with torch._C.DisableTorchFunctionSubclass():
        return bool(getattr(tensor, f"is_{kind}"))


def _device_of_tensor(tensor: Any) -> Any:
    torch = _state.torch
    ordinal = _ordinal(tensor)
    if ordinal is None:
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.device
    return torch.device(_state.kind, ordinal)


def _get_device(tensor: Any) -> int:
    ordinal = _ordinal(tensor)
    return -1 if ordinal is None else ordinal


def _on_host(tensor: Any, what: str) -> Any:
    """``tensor`` as a plain host tensor, for what CUDA refuses to do where it is (numpy)."""
    ordinal = _ordinal(tensor)
    if ordinal is not None:
        raise TypeError(
            f"can't convert {_state.kind}:{ordinal} device type tensor to {what}. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )
    return _host_alias(tensor)


def _numpy(tensor: Any, *, force: bool = False) -> Any:
    """``Tensor.numpy``: refused on a GPU, unless ``force`` (then a copy on the host, as torch's)."""
    return (_cpu(tensor) if force else _on_host(tensor, "numpy")).numpy(force=force)


def _array(tensor: Any, dtype: Any = None) -> Any:
    """``Tensor.__array__`` (``numpy.asarray``): refused on a GPU, as ``numpy()``."""
    host = _on_host(tensor, "numpy")
    return host.__array__() if dtype is None else host.__array__(dtype)


def _repr(tensor: Any, *, tensor_contents: Any = None) -> str:
    """torch's own printing, with the device answered as above and torch's ``tensor(`` prefix."""
    text: str = _state.torch._tensor_str._str(tensor, tensor_contents=tensor_contents)
    name = f"{type(tensor).__name__}("
    return "tensor(" + text[len(name) :] if text.startswith(name) and len(name) == len("tensor(") else text


def _format(tensor: Any, spec: str) -> str:
    if tensor.dim() == 0 and not tensor.is_meta:
        return format(tensor.item(), spec)
    return object.__format__(tensor, spec)


def _host_alias(tensor: Any) -> Any:
    """A plain ``torch.Tensor`` viewing ``tensor``'s storage."""
    torch = _state.torch
    with torch._C.DisableTorchFunctionSubclass(), torch._C._DisableTorchDispatch():
        return torch.Tensor._make_subclass(torch.Tensor, tensor, tensor.requires_grad)


def _reduce_ex(tensor: Any, proto: int) -> Any:
    """``torch.save`` and pickle: a CPU tensor (torch.load gives it back on the host)."""
    return _host_alias(tensor).__reduce_ex__(proto)


def _new_tensor(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.new_tensor(data)``: on ``x``'s device unless ``device=`` says otherwise."""
    ordinal = _ordinal(self)
    device = kwargs.get("device")
    if device is None and ordinal is not None:
        kwargs["device"] = _state.torch.device(_state.kind, ordinal)
    elif device is not None:
        kwargs["device"] = _with_its_index(device)
    return _state.methods["new_tensor"](self, data, *args, **kwargs)


def _with_its_index(device: Any) -> Any:
    """``device``, or, for a bare "cuda" (torch.device("cuda")), the current one."""
    if isinstance(device, (str, _state.torch.device)):
        parsed = _state.torch.device(device)
        if parsed.type == _state.kind:
            return _resolve(parsed)
    return device


def _with_index(name: str) -> Callable[..., Any]:
    """``torch.tensor``, ``as_tensor``, ``asarray``: their C++ needs a device's index, which
    torch's CPU build cannot look up for "cuda"; the current device's is given."""
    function = _state.methods[name]

    def call(data: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("device") is not None:
            kwargs["device"] = _with_its_index(kwargs["device"])
        elif name == "as_tensor" and len(args) >= 2:
            args = (args[0], _with_its_index(args[1]), *args[2:])
        return function(data, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = function.__doc__
    return call


def _compatible(tensor: Any, other: Any) -> bool:
    """``torch._has_compatible_shallow_copy_type``: no ``param.data = moved`` between the host
    and a simulated GPU, so ``Module.to`` makes new parameters, as for a device type of its own."""
    if (_ordinal(tensor) is None) != (_ordinal(other) is None):
        return False
    torch = _state.torch
    with torch._C.DisableTorchFunctionSubclass():
        return bool(torch._has_compatible_shallow_copy_type(tensor, other))


# -- Tensor.to, cuda/xpu, cpu ---------------------------------------------------------------------


def _resolve(device: Any) -> Any:
    """A simulated GPU's ``torch.device`` with its index (a bare "cuda": the current device)."""
    torch = _state.torch
    if device.index is not None:
        return device
    return torch.device(_state.kind, getattr(torch, _state.kind).current_device())


def _move(tensor: Any, device: Any, dtype: Any, non_blocking: bool, copy: bool, memory_format: Any) -> Any:
    """``Tensor.to`` to ``device`` (None: stay), as torch's ``to_impl``: ``tensor`` itself when
    nothing changes (``to_will_alias``), else ``_to_copy``."""
    torch = _state.torch
    here = _ordinal(tensor)
    if device is not None and device.type == _state.kind:
        device = _resolve(device)
        same = here == device.index
    elif device is not None and device.type == "cpu":
        same = here is None
    else:
        same = device is None
    with torch._C.DisableTorchFunctionSubclass():
        dtype_same = dtype is None or dtype == tensor.dtype
        format_same = memory_format is None or memory_format == torch.preserve_format
        if not format_same:
            format_same = tensor.is_contiguous(memory_format=memory_format)
    if same and dtype_same and format_same and not copy:
        return tensor
    kwargs: dict[str, Any] = {"dtype": dtype, "non_blocking": non_blocking, "memory_format": memory_format}
    if not same:
        kwargs["device"] = device
    return torch.ops.aten._to_copy.default(tensor, **{k: v for k, v in kwargs.items() if v is not None})


def _to(self: Any, *args: Any, **kwargs: Any) -> Any:
    torch = _state.torch
    other = kwargs.get("other", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    # copy= comes after non_blocking: 4th positional of to(device, dtype, ...), 3rd of the others
    position = 3 if args and other is None and not isinstance(args[0], torch.dtype) else 2
    parse_args, parse_kwargs = args[:position], {k: v for k, v in kwargs.items() if k != "copy"}
    copy = bool(args[position] if len(args) > position else kwargs.get("copy", False))
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*parse_args, **parse_kwargs)
    if other is not None:
        device = _device_of_tensor(other)
    if _ordinal(self) is None and (device is None or device.type != _state.kind):
        return _state.methods["to"](self, *args, **kwargs)  # on the host, staying there: torch's own
    if device is not None and device.type not in (_state.kind, "cpu"):
        return _state.methods["to"](self, *args, **kwargs)  # another device type: fails as the CPU build does
    return _move(self, device, dtype, bool(non_blocking), copy, memory_format)


def _device_method(kind: str) -> Callable[..., Any]:
    def method(self: Any, device: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Any:
        if kind != _state.kind:  # not this machine's device type: torch's own (which fails)
            extra = {} if memory_format is None else {"memory_format": memory_format}
            return _state.methods[kind](self, device, non_blocking, **extra)
        torch = _state.torch
        if device is None:
            target = torch.device(kind)
        elif isinstance(device, int):
            target = torch.device(kind, device)
        else:
            target = torch.device(device)
            if target.type != kind:
                raise RuntimeError(f"Invalid device, must be {kind} device")
        return _move(self, target, None, non_blocking, False, memory_format)

    method.__name__ = method.__qualname__ = kind
    method.__doc__ = f"``Tensor.{kind}``: to the simulated GPU (default: the current one)."
    return method


def _cpu(self: Any, memory_format: Any = None) -> Any:
    """``Tensor.cpu``: a copy on the host (the tensor itself when it is there)."""
    return _move(self, _state.torch.device("cpu"), None, False, False, memory_format)
