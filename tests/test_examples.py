"""examples/: every script runs as a user runs it (a subprocess from the repository root) and prints what an
independent computation gives: the operators against an unrolled Sinkhorn, the attention weights recomputed, the
Hugging Face losses along the printed beams, the fine-tuned checkpoint against the shipped one. README.md's marked
output blocks are the scripts' output."""

import functools
import hashlib
import importlib.util
import math
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, clean_env
from ot_reference import sinkhorn_topk

from fairseq_softtopk.checkpoint_safety import FAIRSEQ_CHECKPOINT_GLOBALS

EXAMPLES = REPO / "examples"
#: the raw Multi30k archives, beside the checkout (as data_prep's docs and configs name them: ../shared/data/multi30k)
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
#: the examples whose output is the same on every run (README may show it)
FIXED_OUTPUT = ("operators", "topk_attention", "huggingface_search")
NUMBER = r"-?\d+\.\d+"


def run_example(name: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    """``python examples/<name>.py *args`` from the repository root, one thread."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, env=clean_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"examples/{name}.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@functools.lru_cache(maxsize=None)
def output(name: str) -> str:
    """What ``examples/<name>.py`` prints (run once per test session)."""
    return run_example(name).stdout


def floats(text: str):
    return [float(x) for x in re.findall(NUMBER, text)]


def rows_after(lines, label: str):
    """The indented number rows printed under the line that starts with ``label``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(label)) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("    ") or "=" in line:
            break
        rows.append(floats(line))
    return torch.tensor(rows, dtype=torch.float64)


def test_operators_prints_the_selection_of_an_unrolled_sinkhorn_and_its_gradient():
    lines = output("operators").splitlines()
    k, epsilon = re.search(r"k = (\d+), epsilon = ([\d.]+)", lines[0]).groups()
    k, epsilon = int(k), float(epsilon)
    scores = rows_after(lines, "scores").requires_grad_()  # (1, n)
    hard = torch.zeros_like(scores).scatter(-1, scores.topk(k).indices, 1.0)
    assert torch.equal(rows_after(lines, "hard top-k"), hard)
    A = sinkhorn_topk(scores, k, epsilon, sorted=False)  # float64, autograd through every iteration
    assert torch.allclose(rows_after(lines, "soft_topk A"), A, atol=6e-4, rtol=0)
    assert float(re.search(r"sum = (\S+)", "\n".join(lines)).group(1)) == pytest.approx(k, abs=1e-3)
    P = sinkhorn_topk(scores, k, epsilon, sorted=True)  # (1, n, k)
    assert torch.allclose(rows_after(lines, "sorted_soft_topk"), P[0].T, atol=6e-4, rtol=0)
    values_line = next(line for line in lines if "values =" in line)
    values = torch.tensor([[float(v) for v in values_line.split("values =")[1].split()]], dtype=torch.float64)
    (A * values).sum().backward()
    assert torch.allclose(rows_after(lines, "d(sum_i"), scores.grad, atol=6e-4, rtol=0)


def test_topk_attention_prints_softmax_of_the_scores_plus_log_of_their_soft_topk():
    text = output("topk_attention")
    k, epsilon = re.search(r"k = (\d+), epsilon = ([\d.]+)", text).groups()
    k, epsilon = int(k), float(epsilon)
    rows = {m.group(1).strip(): (torch.tensor(floats(m.group(2)), dtype=torch.float64)[None], m.group(3))
            for m in re.finditer(rf"^(\D+?)((?:\s+{NUMBER})+)(?:\s+keys > 1%: (\d+))?$", text, re.M)}
    scores = rows["scores"][0]
    A = sinkhorn_topk(scores, k, epsilon, sorted=False)
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.topk(k).indices, True)
    expected = {"soft top-k A": A, "softmax": scores.softmax(-1), "soft_topk": (scores + A.log()).softmax(-1),
                "hard_topk": scores.masked_fill(~kept, -math.inf).softmax(-1)}
    for label, weights in expected.items():
        printed, count = rows[label]
        assert torch.allclose(printed, weights, atol=6e-4, rtol=0), label
        if count is not None:
            assert int(count) == int((weights > 0.01).sum()), label
    assert "equals softmax(scores + log A): True" in text
    outside = re.search(rf"outside the top {k}: softmax ({NUMBER}), soft_topk ({NUMBER}), hard_topk ({NUMBER})", text)
    for printed, label in zip(map(float, outside.groups()), ("softmax", "soft_topk", "hard_topk")):
        assert printed == pytest.approx(1 - expected[label].topk(k).values.sum().item(), abs=6e-4)


def _search_blocks(text: str):
    """``{mode: (best beams' tokens (batch, steps), their scores (batch,), loss, gradient norm)}`` of the Hugging
    Face example's output."""
    blocks = {}
    for mode, body in re.findall(r"^(\w+) search: (.*?)(?=^\w+ search:|\Z)", text, re.M | re.S):
        sentences = re.findall(r"beam scores ([-\d. ]+); best beam (\d+): \[([\d, ]+)\]", body)
        best = torch.tensor([[int(t) for t in tokens.split(",")] for _, _, tokens in sentences])
        best_scores = torch.tensor([floats(scores)[int(i)] for scores, i, _ in sentences], dtype=torch.float64)
        loss, norm = re.search(rf"loss ({NUMBER}) per label token, gradient norm ({NUMBER})", body).groups()
        blocks[mode] = (best, best_scores, float(loss), float(norm))
    return blocks


def _grad_norm(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()


def test_huggingface_example_prints_the_losses_recomputed():
    """Hard: the printed best beam's score and the gold-token NLL along it come from one teacher-forced forward of
    the model on that beam's tokens; soft: the search rerun in this process, its loss summed here from the gold
    tokens' log-probabilities."""
    pytest.importorskip("transformers")
    from fairseq_softtopk.adapters.huggingface import Seq2SeqSearchDecoder
    from fairseq_softtopk.search import BeamSearchConfig, beam_search

    blocks = _search_blocks(output("huggingface_search"))
    assert set(blocks) == {"soft", "hard"}
    spec = importlib.util.spec_from_file_location("huggingface_search", EXAMPLES / "huggingface_search.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, src, labels = example.tiny_marian()  # the example's seeded model and data
    mask = labels.ne(-100)
    assert bool(mask.all())  # the best beams below are the loss's paths only where no sentence is shorter
    best, best_scores, loss, norm = blocks["hard"]
    assert best.shape == labels.shape
    decoder_inputs = torch.cat([torch.full_like(best[:, :1], model.config.decoder_start_token_id), best[:, :-1]], 1)
    lprobs = model(input_ids=src, decoder_input_ids=decoder_inputs).logits.log_softmax(-1)  # (batch, steps, V)
    own = lprobs.detach().gather(-1, best.unsqueeze(-1)).squeeze(-1).sum(-1)  # each beam's log-likelihood
    assert torch.allclose(best_scores, own.double(), atol=6e-3, rtol=0)
    nll = -(lprobs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask).sum() / mask.sum()
    nll.backward()
    assert loss == pytest.approx(nll.item(), abs=2e-4)
    assert norm == pytest.approx(_grad_norm(model), rel=1e-3)
    model.zero_grad()
    decoder = Seq2SeqSearchDecoder(model)
    out = beam_search(decoder, decoder.encode(src), labels, pad=-100, bos=decoder.bos,
                      config=BeamSearchConfig(beam=5, mode="soft", epsilon=0.1))
    soft_loss = (-(out.gold_lprobs * mask).sum() + out.scale_probe) / mask.sum()  # the cap's unit (the default)
    soft_loss.backward()
    best, best_scores, loss, norm = blocks["soft"]
    assert torch.equal(best, out.tokens[torch.arange(len(src)), out.best_beam])
    assert torch.allclose(best_scores, out.final_scores.detach()[torch.arange(len(src)), out.best_beam].double(),
                          atol=6e-3, rtol=0)
    assert loss == pytest.approx(soft_loss.item(), abs=2e-4) and loss != blocks["hard"][2]
    assert norm == pytest.approx(_grad_norm(model), rel=1e-3)


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory):
    """Multi30k En-De as ``data_prep/prepare_multi30k.sh --local`` prepares it (the checkpoint's data)."""
    if not (MULTI30K / "train.en.gz").is_file():
        pytest.skip(f"the raw Multi30k archives are not in {MULTI30K} (the shared data beside the checkout)")
    out = tmp_path_factory.mktemp("multi30k") / "en_de"
    # one worker: the same files (dict md5 checked by the example), in 29 s instead of 63 s on the loaded 2 cores
    # (fairseq-preprocess's workers each import fairseq)
    proc = subprocess.run(["bash", str(REPO / "data_prep" / "prepare_multi30k.sh"), "--local", str(MULTI30K),
                           "--out", str(out), "--workers", "1"], capture_output=True, text=True,
                          env={**clean_env(), "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


GERMAN = {"ein", "eine", "einem", "einer", "der", "die", "das", "dem", "den", "im", "auf", "mit", "und", "zwei"}


def test_finetune_example_trains_the_shipped_checkpoint_and_translates(multi30k, tmp_path):
    work = tmp_path / "work"
    text = run_example("finetune_transformer_checkpoint", "--data-dir", multi30k, "--work-dir", work,
                       "--updates", 2, "--max-tokens", 100).stdout
    before, after = text.split("fine-tuning", 1)[0], text.split("fine-tuned checkpoint", 1)[1]
    for block in (before, after):
        pairs = re.findall(r"^  (.+?) -> (.*)$", block, re.M)
        assert len(pairs) == 2, text
        for english, german in pairs:
            assert german and german != english and GERMAN & set(re.findall(r"\w+", german.lower())), text
    loss, tf_loss, beam_loss = map(float, re.search(
        rf"training loss ({NUMBER}) bits/token \(teacher forcing ({NUMBER}), beam ({NUMBER})\)", text).groups())
    assert all(map(math.isfinite, (loss, tf_loss, beam_loss)))
    # the printed loss is the mean over the updates that fairseq logged, weighted by their target tokens
    updates = re.findall(r"\| train_inner \| .*? loss=([\d.]+),.* wpb=([\d.]+),", (work / "train.log").read_text())
    assert len(updates) == 2
    weights = [float(w) for _, w in updates]
    assert loss == pytest.approx(sum(float(x) * w for (x, _), w in zip(updates, weights)) / sum(weights), abs=2e-3)
    shipped, tuned = (_model_state(path) for path in (REPO / "checkpoints" / "multi30k_en_de_transformer_tf" /
                                                       "checkpoint_best.pt", work / "checkpoint_last.pt"))
    assert shipped.keys() == tuned.keys()
    assert any(not torch.equal(shipped[name], tuned[name]) for name in shipped)
    assert all(torch.isfinite(value).all() for value in tuned.values() if value.is_floating_point())
    again = run_example("finetune_transformer_checkpoint", "--data-dir", multi30k, "--work-dir", work, check=False)
    assert again.returncode == 2 and "already holds a fine-tuned checkpoint" in again.stderr


def _model_state(path):
    """A fairseq checkpoint's model parameters, loaded weights-only (with the globals fairseq checkpoints hold)."""
    with torch.serialization.safe_globals(list(FAIRSEQ_CHECKPOINT_GLOBALS)):
        return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_finetune_example_says_how_to_prepare_missing_or_other_data_and_refuses_bad_sizes(tmp_path):
    proc = run_example("finetune_transformer_checkpoint", "--data-dir", tmp_path / "none", "--work-dir",
                       tmp_path / "work", check=False)
    assert proc.returncode == 2
    assert f"{tmp_path / 'none' / 'bin' / 'dict.en.txt'} not found" in proc.stderr
    assert f"bash data_prep/prepare_multi30k.sh --out {tmp_path / 'none'}" in proc.stderr
    for name in ("bin/dict.en.txt", "bpe/spm.model"):
        (tmp_path / "other" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "other" / name).write_text("the 12\n")
    proc = run_example("finetune_transformer_checkpoint", "--data-dir", tmp_path / "other", "--work-dir",
                       tmp_path / "work", check=False)
    assert proc.returncode == 2 and hashlib.md5(b"the 12\n").hexdigest() in proc.stderr
    assert "b8a542765475fec7cd51aacbc38edc9c" in proc.stderr and "prepare_multi30k.sh" in proc.stderr
    for flag in ("--updates", "--max-tokens"):  # fairseq-train would read --max-update 0 as "no limit"
        proc = run_example("finetune_transformer_checkpoint", "--data-dir", tmp_path / "other", "--work-dir",
                           tmp_path / "work", flag, 0, check=False)
        assert proc.returncode == 2 and f"{flag} must be >= 1, got 0" in proc.stderr
    assert not (tmp_path / "work").exists()


README_BLOCK = re.compile(r"^<!-- output of examples/(\w+)\.py -->\s*\n```[^\n]*\n(.*?)^```", re.M | re.S)


@pytest.mark.parametrize("name", FIXED_OUTPUT)
def test_readme_output_block_is_what_the_example_prints(name):
    readme = (REPO / "README.md").read_text()
    marker = f"<!-- output of examples/{name}.py -->"
    if marker not in readme:
        pytest.skip(f"README.md has no '{marker}' block yet")
    blocks = dict(README_BLOCK.findall(readme))
    assert name in blocks, f"README.md's '{marker}' is not followed by a fenced block"
    assert blocks[name] == output(name)


def test_readme_marks_only_examples_with_a_fixed_output():
    marked = re.findall(r"<!-- output of examples/(\S+?)\.py -->", (REPO / "README.md").read_text())
    if not marked:
        pytest.skip("README.md marks no example output yet")
    assert set(marked) <= set(FIXED_OUTPUT), f"{marked}: only {FIXED_OUTPUT} print the same output on every run"


def test_examples_readme_lists_every_example():
    listed = (EXAMPLES / "README.md").read_text()
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts and [script for script in scripts if f"examples/{script}" not in listed] == []


def test_huggingface_trainer_example_learns_its_pairs_and_batches_as_the_model_expects():
    """Seq2SeqTrainer with the soft beam-search loss: the printed losses fall and, after training, the printed
    hypotheses are the reversed sources (checked here, line by line) as many times as the count says; the example's
    collator gives the batch Marian's own ``shift_tokens_right`` and padding rules give."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers.models.marian.modeling_marian import shift_tokens_right

    text = output("huggingface_trainer")
    n = int(re.search(r"^(\d+) pairs", text, re.M).group(1))
    before, after = (int(m) for m in re.findall(rf"^generate\(num_beams=4\) .*?: (\d+) of {n} right$", text, re.M))
    losses = floats(re.search(r"^  ([\d., ]+) \(every \d+ updates\)$", text, re.M).group(1))
    assert len(losses) == 10 and losses[-1] < 0.2 * losses[0] and before == 0
    pairs = re.findall(r"^  \[([\d, ]+)\] -> \[([\d, ]*)\]$", text, re.M)
    assert len(pairs) == n
    reversed_right = sum([int(t) for t in hyp.split(", ") if t] == [int(t) for t in src.split(", ")][-2::-1] + [1]
                         for src, hyp in pairs)
    assert reversed_right == after >= n - 2
    spec = importlib.util.spec_from_file_location("huggingface_trainer", EXAMPLES / "huggingface_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.reversal_pairs(5, seed=3)
    batch = example.collate(rows)
    lengths = [len(row["labels"]) for row in rows]
    assert len(set(lengths)) > 1  # padding to check
    config = example.build_model().config
    padded = batch["labels"].masked_fill(batch["labels"] == -100, config.pad_token_id)
    assert torch.equal(batch["decoder_input_ids"],
                       shift_tokens_right(padded, config.pad_token_id, config.decoder_start_token_id))
    for b, row in enumerate(rows):
        assert batch["labels"][b].tolist() == row["labels"] + [-100] * (max(lengths) - lengths[b])
        assert batch["attention_mask"][b].sum() == len(row["input_ids"])
        assert batch["input_ids"][b, :len(row["input_ids"])].tolist() == row["input_ids"]
