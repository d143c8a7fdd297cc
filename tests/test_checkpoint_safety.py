"""The weights-only allowlist's numpy globals: what numpy's own pickles of arrays reference, under numpy 1 and 2."""

import io
import pickle
import re
import sys
import types

import numpy
import pytest

from fairseq_softtopk import checkpoint_safety


def _referenced_globals(payload: bytes) -> list:
    """The objects a pickle's GLOBAL opcodes resolve to, in the order the unpickler asks for them."""
    found = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            obj = super().find_class(module, name)
            found.append(obj)
            return obj

    Recording(io.BytesIO(payload)).load()
    return found


@pytest.mark.parametrize("dtype", ["int64", "int32", "float64", "float32"])
def test_every_global_of_a_pickled_numeric_array_is_allowlisted(dtype):
    """--eval-bleu's saved metrics are such arrays: each object their pickle names must be allowed."""
    referenced = _referenced_globals(pickle.dumps(numpy.arange(4, dtype=dtype)))
    assert referenced, "a numpy array pickles through module globals"
    allowed = checkpoint_safety._numpy_array_globals()
    assert all(any(obj is a for a in allowed) for obj in referenced), referenced


def _fake_numpy(monkeypatch, version: str, module_with_reconstruct: str, core_stub: bool) -> object:
    """Installs a stand-in ``numpy`` in ``sys.modules``: the real dtypes, a marker ``_reconstruct`` in
    ``module_with_reconstruct``, and (numpy 1.26's layout) an empty, unimported ``numpy._core`` package."""
    marker = object()
    fake = types.ModuleType("numpy")
    fake.__version__, fake.dtype, fake.ndarray = version, numpy.dtype, numpy.ndarray
    if core_stub:
        fake._core = types.ModuleType("numpy._core")
    multiarray = types.ModuleType(module_with_reconstruct)
    multiarray._reconstruct = marker
    monkeypatch.setitem(sys.modules, "numpy", fake)
    monkeypatch.setitem(sys.modules, module_with_reconstruct, multiarray)
    return marker


def test_numpy_1_with_an_unimported_core_stub_takes_numpy_core(monkeypatch):
    """numpy 1.26 has a ``numpy._core`` package whose ``multiarray`` is not imported: the plugin failed
    at import there (AttributeError), found on torch 2.1 with numpy 1.26."""
    marker = _fake_numpy(monkeypatch, "1.26.4", "numpy.core.multiarray", core_stub=True)
    assert checkpoint_safety._numpy_array_globals()[0] is marker


def test_numpy_2_takes_numpy_private_core(monkeypatch):
    marker = _fake_numpy(monkeypatch, "2.1.0", "numpy._core.multiarray", core_stub=False)
    assert checkpoint_safety._numpy_array_globals()[0] is marker


@pytest.mark.parametrize("version, release", [("2.11.0+cu130", (2, 11)), ("2.6.0a0+git1234", (2, 6)),
                                              ("2.1.2", (2, 1)), ("3.0.0", (3, 0))])
def test_torch_release_reads_major_and_minor(version, release):
    assert checkpoint_safety.torch_release(version) == release


@pytest.mark.parametrize("version", ["2.1.2+cu121", "2.5.1"])
def test_a_torch_without_weights_only_loading_is_refused_by_name(version):
    with pytest.raises(RuntimeError, match=rf"needs torch >= 2\.6, found torch {re.escape(version)}.*run code"):
        checkpoint_safety.require_weights_only_torch(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.11.0+cu130", "2.13.0+cpu", "3.1.0"])
def test_a_weights_only_torch_is_accepted(version):
    checkpoint_safety.require_weights_only_torch(version)


def test_register_refuses_an_old_torch_before_registering_anything(monkeypatch):
    """Found with torch 2.1.2: fairseq-generate ran the code pickled in a checkpoint (torch.load's default
    was weights_only=False before 2.6)."""
    import torch

    import fairseq_softtopk

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(RuntimeError, match="needs torch >= 2.6"):
        fairseq_softtopk.register()
