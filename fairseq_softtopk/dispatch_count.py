"""What a GPU would launch and wait for, counted on any device: dispatched ATen operations and host syncs.

On a GPU, a step of eager PyTorch costs at least one kernel launch per ATen operation (a few
microseconds each, whatever the tensor size), and every host synchronisation stalls the CPU until
the device has caught up, which also keeps a step out of CUDA graphs. Both can be counted without a
GPU: :class:`DispatchCounter` sees every operation below autograd (a ``TorchDispatchMode``, active
in the backward pass too) and the host reads above it (a ``TorchFunctionMode``):

* **launches**: dispatched ATen operations that would run a kernel, and the package's own Triton
  kernel launches (inside its custom ops, with the ATen operations they run around the kernels; under
  Triton's interpreter, the interpreter's own host work is not counted): everything but views,
  ``detach``/``alias``, uninitialised allocations (``empty*``), the profiler's range markers and
  the host reads below (an approximation: a few operations launch several kernels, ``topk`` or a
  batched solve, and a compiler fuses many into one);
* **syncs**: operations that make the host wait for the device: reading a value
  (``.item()``, ``bool()``, ``int()``, ``float()``: ``aten._local_scalar_dense``), copying to
  the host (``.cpu()``, ``.tolist()``, ``.numpy()``), and operations whose output size depends on
  the data (``nonzero``, ``masked_select``, boolean indexing, ``unique``, ``bincount``,
  ``repeat_interleave`` without ``output_size``), ``linalg.solve``'s error check, and tensors made
  from Python data (``torch.tensor``, ``torch.as_tensor`` of a number or list, ``Tensor.new_tensor``):
  on a GPU that is a copy from pageable host memory, which waits for the device (and is what
  ``torch.cuda.set_sync_debug_mode`` reports); ``torch.full`` or a Python scalar in ``torch.where``
  launches a kernel instead.

Each count is attributed to the package's named ``torch.profiler`` ranges (``softtopk::...``) open
when it happened: its *path*, e.g. ``("beam_step", "select_beams", "sorted_soft_topk")``, or
``("backward",)`` / ``("other",)`` outside any range in the backward / forward pass.
"""

from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .ops.kernels.loading import kernel_running, watching_launches

__all__ = ["DispatchCounter", "RANGE_PREFIX"]

#: The package's named ranges start with this (``softtopk::sorted_soft_topk``, ...).
RANGE_PREFIX = "softtopk::"

_aten = torch.ops.aten
#: Operations that make the host wait for the device (besides the host reads seen above autograd).
_SYNC_OPS = {
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten.unique_consecutive.default, _aten._unique2.default, _aten.unique_dim.default, _aten.bincount.default,
    _aten.linalg_solve.default, _aten.equal.default, _aten.is_nonzero.default,
}
#: Operations that launch no kernel: allocations without initialisation, aliases, markers.
_FREE_OPS = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default, _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default,
}
_RECORD_ENTER = {torch.ops.profiler._record_function_enter.default, torch.ops.profiler._record_function_enter_new.default}
_RECORD_EXIT = {torch.ops.profiler._record_function_exit.default, torch.ops.profiler._record_function_exit._RecordFunction}
#: The package's custom ops (fairseq_softtopk::sorted_soft_topk_forward, ...): what they run is counted, the ATen
#: operations around their kernels and each kernel launch (``ops.kernels.loading.launch``), not the op itself
_PACKAGE_NAMESPACE = "fairseq_softtopk"
#: Tensor methods that copy to the host (on a CPU tensor they dispatch nothing, so they are seen above autograd).
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
#: marks the tensors a counted host copy returned (moving them to the host again is free)
_ON_HOST = "_dispatch_count_on_host"
#: factories that copy Python data from the host: ``{function: position of the data argument}``
_FROM_HOST_DATA = {torch.tensor: 0, torch.as_tensor: 0, torch.Tensor.new_tensor: 1}


def _is_sync(func, args, kwargs) -> bool:
    if func in _SYNC_OPS:
        return True
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        # a boolean index is turned into the indices of its True entries, whose number depends on the data
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype == torch.bool for i in indices)
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: "DispatchCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if kernel_running():  # a kernel under Triton's interpreter: its host work is no launch (the kernel is one)
            return func(*args, **kwargs)
        if func in _RECORD_ENTER:
            counter._stack.append(args[0])
        elif func in _RECORD_EXIT:
            if counter._stack:
                counter._stack.pop()
        elif _is_sync(func, args, kwargs):
            counter._count("syncs", func)
            if func is not _aten._local_scalar_dense.default:  # nonzero & co. also run a kernel
                counter._count("launches", func)
        elif func.namespace == _PACKAGE_NAMESPACE:
            impl = _package_impl(func)
            if impl is not None:  # run under the counter: its ATen operations and kernel launches are counted
                with self:
                    return impl(*args, **kwargs)
            counter._count("launches", func)  # torch keeps the function elsewhere: the op counts as one kernel
        elif func not in _FREE_OPS and not func.is_view and func.namespace == "aten":
            counter._count("launches", func)
        return func(*args, **kwargs)


def _package_impl(func):
    """The Python function behind one of the package's custom ops (``torch.library.custom_op``), called
    in place of the op so that the operations it runs are seen; None where torch does not expose it."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # the registry moved: the op counts as its kernel alone
        return None
    return getattr(OPDEFS.get(func._schema.name), "_init_fn", None)


class _HostReads(TorchFunctionMode):
    def __init__(self, counter: "DispatchCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_HOST_DATA and _host_data(func, args, kwargs):
            self.counter._count("syncs", func)
            return func(*args, **kwargs)
        if func in _HOST_READS or (func is torch.Tensor.to and _to_host(args, kwargs)):
            if getattr(args[0], _ON_HOST, False):  # a copy this pass already made to the host: no device involved
                return func(*args, **kwargs)
            self.counter._count("syncs", func)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                setattr(out, _ON_HOST, True)
            return out
        return func(*args, **kwargs)


def _host_data(func, args, kwargs) -> bool:
    """Whether a factory of :data:`_FROM_HOST_DATA` is given Python data (not a tensor)."""
    position = _FROM_HOST_DATA[func]
    data = args[position] if len(args) > position else kwargs.get("data")
    return not isinstance(data, torch.Tensor)


def _to_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the CPU as its target device."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
    return False


class DispatchCounter:
    """Counts launches and syncs (module docstring) while active, per path of open ranges.

    Example::

        with DispatchCounter() as counter:
            loss = criterion(model, sample)[0]
            loss.backward()
        counter.total("launches"), counter.total("syncs", inside="beam_step")

    Attributes:
        ops: ``{kind: Counter({(path, op name): n})}`` for ``kind`` in ``("launches", "syncs")``, ``path``
            a tuple of range names without their prefix (module docstring); :attr:`counts` sums the ops.
    """

    KINDS = ("launches", "syncs")

    def __init__(self):
        self.ops: Dict[str, Counter] = {kind: Counter() for kind in self.KINDS}
        self._stack: List[str] = []
        self._modes = (_HostReads(self), _Dispatch(self))

    def path(self) -> Tuple[str, ...]:
        """The open package ranges, outermost first (module docstring)."""
        path = tuple(name[len(RANGE_PREFIX):] for name in self._stack if name.startswith(RANGE_PREFIX))
        if path:
            return path
        return ("backward",) if torch._C._current_autograd_node() is not None else ("other",)

    def _count(self, kind: str, func) -> None:
        self.ops[kind][(self.path(), getattr(func, "__name__", str(func)))] += 1

    @property
    def counts(self) -> Dict[str, Counter]:
        """``{kind: Counter({path: n})}``: :attr:`ops` summed over the operations."""
        out: Dict[str, Counter] = {kind: Counter() for kind in self.KINDS}
        for kind, ops in self.ops.items():
            for (path, _), n in ops.items():
                out[kind][path] += n
        return out

    def total(self, kind: str, inside: Optional[str] = None, innermost: Optional[str] = None) -> int:
        """Count of ``kind``: everywhere, or where the range ``inside`` is open, or where ``innermost``
        is the innermost open range (``"backward"``, ``"other"`` included)."""
        return sum(n for path, n in self.counts[kind].items()
                   if (inside is None or inside in path) and (innermost is None or path[-1] == innermost))

    def by_innermost(self, kind: str) -> Dict[str, int]:
        """``{innermost range: count}`` of ``kind``."""
        out: Counter = Counter()
        for path, n in self.counts[kind].items():
            out[path[-1]] += n
        return dict(out)

    def __enter__(self) -> "DispatchCounter":
        self._watch = watching_launches(lambda name: self._count("launches", name))
        self._watch.__enter__()
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._watch.__exit__(*exc)
