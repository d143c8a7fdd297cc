"""The weights-only allowlist's numpy globals: what numpy's own pickles of arrays reference, under numpy 1 and 2."""

import io
import pickle
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
