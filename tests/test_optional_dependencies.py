"""matplotlib, entmax and transformers are optional: the package imports, trains with its defaults and decodes
without them; the sparse normalisers and the Hugging Face adapters say which package they need."""

import subprocess
import sys
import textwrap

from conftest import clean_env

BLOCK_AND_TRAIN = textwrap.dedent("""
    import sys

    class Blocked:  # a meta path finder that hides the optional packages
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("matplotlib", "entmax"):
                raise ImportError(f"{name} is blocked by the test")

    sys.meta_path.insert(0, Blocked())
    sys.path.insert(0, "tests")
    import torch
    from builders import build_criterion, build_model, make_sample
    from conftest import word_dictionary

    dictionary = word_dictionary(13)
    model = build_model(dictionary, scale=3.0, attention_normalizer="soft_topk", attention_topk=2)
    loss = build_criterion(dictionary)(model, make_sample(dictionary, torch.Generator().manual_seed(0), [5, 3, 4]))[0]
    loss.backward()
    assert torch.isfinite(loss)
    assert not any(name.split(".")[0] in ("matplotlib", "entmax") for name in sys.modules)
    try:
        build_model(dictionary, attention_normalizer="sparsemax")(**make_sample(
            dictionary, torch.Generator().manual_seed(0), [5, 3])["net_input"])
    except ImportError as error:
        print("ERROR:", error)
""")


def test_training_needs_neither_matplotlib_nor_entmax(repo_root):
    proc = subprocess.run([sys.executable, "-c", BLOCK_AND_TRAIN], cwd=repo_root, capture_output=True, text=True,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR: --attention-normalizer sparsemax needs the entmax package: pip install entmax" in proc.stdout


def test_optional_dependencies_are_declared_as_extras(repo_root):
    text = (repo_root / "pyproject.toml").read_text()
    dependencies = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "matplotlib" not in dependencies and "entmax" not in dependencies
    assert 'plot = ["matplotlib"]' in text and 'sparse-attention = ["entmax>=1.1"]' in text


def test_the_hugging_face_adapters_name_their_extra_without_transformers(repo_root):
    code = textwrap.dedent("""
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "transformers":
                    raise ImportError(f"{name} is blocked by the test")

        sys.meta_path.insert(0, Blocked())
        from fairseq_softtopk.adapters.huggingface import CausalLMSearchDecoder
        from fairseq_softtopk.search import beam_search
        try:
            CausalLMSearchDecoder(object())
        except ImportError as error:
            print("ERROR:", error)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR: the Hugging Face adapters need transformers: pip install 'fairseq-softtopk[hf]'" in proc.stdout


def test_the_hugging_face_extra_is_declared(repo_root):
    text = (repo_root / "pyproject.toml").read_text()
    dependencies = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "transformers" not in dependencies and 'hf = ["transformers>=5.23,<5.40", "accelerate>=1.1"]' in text
