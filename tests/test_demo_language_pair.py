"""The main job's generated language pair (fairseq_softtopk/data/demo_language_pair.py)."""

from collections import Counter

import pytest

from fairseq_softtopk.data.demo_language_pair import (MAX_LENGTH, MIN_LENGTH, build_demo_lexicon,
                                                      generate_demo_corpus, write_demo_corpus)


def test_deterministic_and_within_the_length_bounds():
    corpus = generate_demo_corpus(300, seed=5)
    assert corpus == generate_demo_corpus(300, seed=5) and corpus != generate_demo_corpus(300, seed=6)
    lengths = [len(source.split()) for source, _ in corpus]
    assert MIN_LENGTH <= min(lengths) and max(lengths) <= MAX_LENGTH
    assert sum(lengths) / len(lengths) > 22  # long sentences, not only the minimum


def _split(tokens, separators):
    clauses = [[]]
    for token in tokens:
        if token in separators:
            clauses.append([])
        else:
            clauses[-1].append(token)
    return clauses


def test_each_clause_verb_agrees_with_its_subject_and_comes_last():
    """Per clause (without a relative clause), the target's last word is the verb: it carries
    the suffix of the subject's determiner (the clause's first target word) and the stem that
    the object's animacy selects (the object follows the verb in the source)."""
    lex = build_demo_lexicon()
    nouns = {noun.source: noun for noun in lex.nouns}
    checked = 0
    for source, target in generate_demo_corpus(1000, seed=7):
        words, out = source.split()[:-1], target.split()[:-1]  # without "."
        if words[0] in lex.adverbs:
            words, out = words[1:], out[2 if out[0] in [m[0] for m, _ in lex.adverbs.values()] else 3:]
        for clause, clause_out in zip(_split(words, lex.conjunctions), _split(out, lex.conjunctions.values())):
            if "that" in clause:
                continue
            verb_at = next(i for i, w in enumerate(clause) if w in lex.verbs)
            obj = nouns[next(w for w in clause[verb_at + 1:] if w in nouns)]
            final = [t for t in clause_out if t != lex.particle][-1]
            stem = lex.verbs[clause[verb_at]][0 if obj.animate else 1]
            assert clause_out[0].startswith("DE") and final == stem + clause_out[0][2:], (source, target)
            checked += 1
    assert checked > 500


def test_adverb_modes_make_greedy_decoding_lose():
    """The two-token translation (0.4) is the most likely sequence, yet the most likely first
    token is the shared first token of the three three-token translations (0.6 in total)."""
    lex = build_demo_lexicon()
    counts = Counter()
    for source, target in generate_demo_corpus(4000, seed=9):
        word = source.split()[0]
        if word in lex.adverbs:
            mode, variants = lex.adverbs[word]
            out = tuple(target.split()[:3])
            counts["mode" if out[:2] == mode else next(f"v{i}" for i, v in enumerate(variants) if v == out)] += 1
    total = sum(counts.values())
    assert total > 2000
    assert counts["mode"] / total == pytest.approx(0.4, abs=0.04)
    for i in range(3):
        assert counts[f"v{i}"] / total == pytest.approx(0.2, abs=0.04)


def test_write_refuses_other_content_before_writing_anything(tmp_path):
    splits = {"train": (20, 1), "valid": (5, 2)}
    assert write_demo_corpus(tmp_path, splits=splits) == {"train": 20, "valid": 5}
    (tmp_path / "valid.tgt").write_text("changed\n")
    (tmp_path / "train.src").unlink()
    with pytest.raises(FileExistsError, match="valid.tgt"):
        write_demo_corpus(tmp_path, splits=splits)
    assert not (tmp_path / "train.src").exists()  # nothing written when any file is refused


def test_names_are_rare_words_with_one_translation_each():
    """ "of NAME" in the source is "DI NAME'" in the target, right after the noun phrase's
    adjectives; each name has one translation; frequencies follow Zipf's law (rank 1 about ten
    times rank 10), so that many names of the test set are rare in training."""
    lex = build_demo_lexicon()
    translation = dict(lex.names)
    assert len(translation) == 1500 and len(set(translation.values())) == 1500
    counts, pairs = Counter(), 0
    for source, target in generate_demo_corpus(3000, seed=11):
        words, out = source.split(), target.split()
        names = [words[i + 1] for i, w in enumerate(words) if w == "of"]
        outs = [out[i + 1] for i, w in enumerate(out) if w == "DI"]
        assert [translation[name] for name in names] == outs, (source, target)
        counts.update(names)
        pairs += len(names)
    assert 1.5 < pairs / 3000 < 2.5
    first, tenth = counts[lex.names[0][0]], counts[lex.names[9][0]]
    assert 5 < first / max(tenth, 1) < 20
    assert len(counts) > 700  # the long tail: most names occur, few often


def test_the_rest_of_the_lexicon_does_not_depend_on_the_names():
    """The names are drawn after every other word: the lexicon is the same with or without them."""
    with_names, without = build_demo_lexicon(), build_demo_lexicon(n_names=0)
    assert with_names.nouns == without.nouns and with_names.verbs == without.verbs
    assert without.names == () and without.name_rate == 0.0
