"""A device check that needs no GPU: tensors created by the package must take the data's device and dtype.

Inside :func:`package_device_check`, every call of a torch tensor factory (``torch.zeros``, ``full``,
``arange``, ``tensor``, ``as_tensor``, ``eye``, ...: the functions that ``with torch.device(...)``
redirects) made directly by a file of ``fairseq_softtopk`` raises :class:`DeviceCheckError`, naming
that file and line,

* when it has no ``device=``: on a GPU the tensor would land on the CPU, and the first operation
  that mixes it with the data fails (as the beam search's ``near_ties`` did at its first CUDA step);
* when it makes a floating-point tensor without ``dtype=``: it would take torch's default dtype
  (float32) whatever the data's (float64 in gradchecks, float16/bfloat16 in mixed precision).

The error is raised where the tensor is created, not where it meets the data, so the file and line
are those to fix. Calls made by torch or fairseq themselves are not checked (fairseq's transformer
creates tensors without a device): only the package's own frames are.

torch's function modes are not active in the autograd engine, so the check also enters its mode in
the ``backward`` of every ``torch.autograd.Function`` of the package (the only package code that runs
in a backward pass: the operators' implicit differentiation, the gradient cap and its observers).
"""

import contextlib
import sys
from pathlib import Path
from typing import List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import fairseq_softtopk

PACKAGE_DIR = Path(fairseq_softtopk.__file__).resolve().parent


class DeviceCheckError(AssertionError):
    """A tensor factory called by the package without the data's device (or dtype)."""


def _package_site(frame) -> Optional[str]:
    """``fairseq_softtopk/...py:line`` of ``frame`` if it runs a file of the package, else None."""
    path = Path(frame.f_code.co_filename)
    try:
        relative = path.resolve().relative_to(PACKAGE_DIR)
    except ValueError:
        return None
    return f"{PACKAGE_DIR.name}/{relative.as_posix()}:{frame.f_lineno}"


class PackageDeviceCheck(TorchFunctionMode):
    """The check of the module docstring; ``sites`` lists every factory call of the package it saw."""

    def __init__(self):
        super().__init__()
        self.constructors = _device_constructors()
        self.sites: List[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.constructors:
            return func(*args, **kwargs)
        site = _package_site(sys._getframe(1))  # the frame that called the factory
        if site is None:
            return func(*args, **kwargs)
        self.sites.append(site)
        name = f"torch.{func.__name__}"
        if kwargs.get("device") is None:
            raise DeviceCheckError(f"{site}: {name}(...) creates a tensor without device= (it would be on the CPU "
                                   f"whatever the data's device); pass device=<the data's>.device or use new_*/*_like")
        out = func(*args, **kwargs)
        if out.is_floating_point() and kwargs.get("dtype") is None:
            raise DeviceCheckError(f"{site}: {name}(...) creates a {out.dtype} tensor without dtype= (torch's default "
                                   f"dtype, whatever the data's); pass dtype=<the data's>.dtype")
        return out


def _package_autograd_functions() -> List[type]:
    """The ``torch.autograd.Function`` subclasses defined in the package (imported so far)."""
    found, todo = [], list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] == PACKAGE_DIR.name:
            found.append(cls)
    return found


@contextlib.contextmanager
def package_device_check():
    """Within the block, the package's tensor factories must name the data's device and dtype (module
    docstring), in the forward and the backward pass.

    Yields the :class:`PackageDeviceCheck`, whose ``sites`` lists the factory calls it checked.
    """
    mode = PackageDeviceCheck()
    originals = {cls: cls.__dict__["backward"] for cls in _package_autograd_functions()}

    def checked(backward):
        def run(*args):
            with mode:
                return backward(*args)
        return staticmethod(run)

    try:
        for cls, backward in originals.items():
            cls.backward = checked(backward.__func__ if isinstance(backward, staticmethod) else backward)
        with mode:
            yield mode
    finally:
        for cls, backward in originals.items():
            cls.backward = backward
