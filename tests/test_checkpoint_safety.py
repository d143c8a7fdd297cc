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


# ---------------------------------------------------------------------------------------------
# Truncated, damaged and missing files; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD


@pytest.fixture
def whole_checkpoint(tmp_path):
    """A small checkpoint that fairseq's loader takes (config, weights, optimizer history): its path."""
    import torch

    path = tmp_path / "whole.pt"
    history = [{"criterion_name": "c", "optimizer_name": "o", "lr_scheduler_state": {"best": 0.0}, "num_updates": 0}]
    torch.save({"cfg": {"model": {"_name": "lstm"}}, "model": {"w": torch.arange(4096.0).view(64, 64)},
                "optimizer_history": history, "extra_state": {"train_iterator": {"epoch": 1}}}, path)
    return path


def _fairseq_loader():
    import fairseq  # noqa: F401  (the plugin registers, and guards fairseq's loader, once fairseq is imported)

    import fairseq_softtopk
    from fairseq import checkpoint_utils

    fairseq_softtopk.register()
    return checkpoint_utils.load_checkpoint_to_cpu


@pytest.mark.parametrize("keep", [0, 1, 3, 100, 0.5, -1])
def test_a_truncated_checkpoint_is_named_with_its_size_by_fairseqs_loader(whole_checkpoint, tmp_path, keep):
    """Cut at the start, inside the zip header, in the middle and one byte short: torch raised EOFError,
    "Weights only load failed", OSError [Errno 22] or a miniz error, naming no file."""
    data = whole_checkpoint.read_bytes()
    size = keep if isinstance(keep, int) and keep >= 0 else int(len(data) * keep) if keep > 0 else len(data) + keep
    cut = tmp_path / "ckpt" / "cut.pt"
    cut.parent.mkdir()
    cut.write_bytes(data[:size])
    with pytest.raises(checkpoint_safety.CorruptCheckpointError) as error:
        _fairseq_loader()(str(cut))
    message = str(error.value)
    assert message.startswith(f"{cut} is not a complete checkpoint: ") and "\n" not in message
    assert f"{size:,} bytes" in message and "truncated by an interrupted copy or write?" in message
    assert _fairseq_loader()(str(whole_checkpoint))["cfg"]["model"]["_name"] == "lstm"  # the whole file loads


def test_a_damaged_or_foreign_file_and_a_missing_one_are_named(whole_checkpoint, tmp_path):
    """One flipped byte in the pickled part (found by the zip's CRC-32), a text file, no file at all."""
    import zipfile

    with zipfile.ZipFile(whole_checkpoint) as archive:
        pickled = next(info for info in archive.infolist() if info.filename.endswith("data.pkl"))
    data = bytearray(whole_checkpoint.read_bytes())
    data[pickled.header_offset + 30 + len(pickled.filename) + 20] ^= 0x01  # inside data.pkl, past its header
    flipped, text = tmp_path / "flipped.pt", tmp_path / "text.pt"
    flipped.write_bytes(bytes(data))
    text.write_text("not a checkpoint\n")
    load = _fairseq_loader()
    with pytest.raises(checkpoint_safety.CorruptCheckpointError, match=rf"^{re.escape(str(flipped))} is not a "
                       r"complete checkpoint: its member \S*data\.pkl fails its CRC-32 check"):
        load(str(flipped))
    with pytest.raises(checkpoint_safety.CorruptCheckpointError,
                       match=rf"^{re.escape(str(text))} is not a complete checkpoint: not a zip archive"):
        load(str(text))
    with pytest.raises(checkpoint_safety.MissingCheckpointError, match="no_such.pt: no such checkpoint file"):
        load(str(tmp_path / "no_such.pt"))


def test_a_checkpoint_whose_tensor_bytes_changed_is_refused_by_fairseqs_loader(whole_checkpoint):
    """Bytes overwritten inside a tensor, the size kept: torch checks no CRC and loaded it (training resumed from it,
    fairseq-generate scored it); fairseq's loader under the plugin now reads the file whole first."""
    import torch

    from conftest import overwrite_tensor_bytes

    member = overwrite_tensor_bytes(whole_checkpoint)
    assert torch.load(whole_checkpoint, weights_only=True)["model"]["w"].shape == (64, 64)  # torch says nothing
    with pytest.raises(checkpoint_safety.CorruptCheckpointError) as error:
        _fairseq_loader()(str(whole_checkpoint))
    assert str(error.value) == (
        f"{whole_checkpoint} is not a complete checkpoint: its member {member} fails its CRC-32 check; "
        f"{whole_checkpoint.stat().st_size:,} bytes; the bytes changed after they were written: damaged on disk or in "
        f"a copy? It was not loaded.")


def test_a_truncated_checkpoint_is_one_line_from_fairseq_generate(toy_data_bin, whole_checkpoint, tmp_path):
    """Through a real fairseq-generate (the plugin as --user-dir), as the scoring runs it: one line
    naming the file, not fairseq's config dump and a traceback ending in OSError [Errno 22]."""
    from fairseq_softtopk.experiments import fairseq_generate

    _, data_bin = toy_data_bin
    cut = tmp_path / "cut.pt"
    data = whole_checkpoint.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(RuntimeError) as error:
        fairseq_generate.run_fairseq_generate(str(data_bin), str(cut), "test")
    message = str(error.value)
    assert message.startswith(f"fairseq-generate refused the checkpoint: {cut} is not a complete checkpoint: ")
    assert f"{len(data) // 2:,} bytes" in message and "\n" not in message


@pytest.mark.parametrize("value, warns", [("1", True), ("YES", True), ("True", True), ("y", True),
                                          ("0", False), ("no", False), ("", False)])
def test_forced_unsafe_loading_warns_once_when_the_plugin_registers(monkeypatch, value, warns):
    """torch honours TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1/y/yes/true (any case): fairseq's loads then unpickle
    anything, and nothing said so."""
    import warnings

    import fairseq  # noqa: F401

    import fairseq_softtopk

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", value)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.setattr(checkpoint_safety, "_warned_unsafe_loading", False)  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # Python's own once-per-place filter would hide a second warning
        fairseq_softtopk.register()
        fairseq_softtopk.register()
    found = [w for w in caught if issubclass(w.category, checkpoint_safety.UnsafeLoadingWarning)]
    assert len(found) == (1 if warns else 0)
    if warns:
        assert f"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD={value} is set" in str(found[0].message)
        assert "can run code" in str(found[0].message)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")  # both: torch refuses every load, nothing unsafe
    assert not checkpoint_safety.unsafe_loading_forced()
