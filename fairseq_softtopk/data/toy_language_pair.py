"""A deterministic toy "language pair" for demos and tests (no download needed).

The source language has a small grammar (subject, verb, object, optional prepositional
phrase; adjectives before nouns). The target language is derived from it by a fixed
lexicon and two reorderings that a translation model has to learn:

* adjectives follow their noun (``big red dog`` -> ``dog' big' red'``), and
* the verb moves to the end of the main clause (SVO -> SOV), before the prepositional phrase.

Some source words translate into two target words, so lengths differ. With a few hundred
words and deterministic rules, BLEU of a trained model is meaningful (an untrained one
scores near 0) and a small LSTM learns it within a minute on a CPU.
"""

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class ToyLexicon:
    """Source word classes and the word-to-word(s) translation table."""

    nouns: Tuple[str, ...]
    verbs: Tuple[str, ...]
    adjectives: Tuple[str, ...]
    prepositions: Tuple[str, ...]
    translation: Dict[str, Tuple[str, ...]]


def _pseudo_words(rng: random.Random, count: int, syllables: Sequence[int], taken: set) -> List[str]:
    words = []
    while len(words) < count:
        n = rng.choice(syllables)
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(n))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def build_lexicon(seed: int = 1, n_nouns: int = 160, n_verbs: int = 60, n_adjectives: int = 60,
                  n_prepositions: int = 10) -> ToyLexicon:
    """Builds the source vocabulary and its translation, deterministically from ``seed``."""
    rng = random.Random(seed)
    taken: set = set()
    nouns = _pseudo_words(rng, n_nouns, (2, 3), taken)
    verbs = _pseudo_words(rng, n_verbs, (2, 3), taken)
    adjectives = _pseudo_words(rng, n_adjectives, (2,), taken)
    prepositions = _pseudo_words(rng, n_prepositions, (1,), taken)
    source_words = nouns + verbs + adjectives + prepositions + ["the"]
    translation: Dict[str, Tuple[str, ...]] = {}
    for word in source_words:
        # Target words are upper-cased pseudo-words, so that copying the source never helps;
        # about one word in eight becomes two target words.
        n_out = 2 if rng.random() < 0.125 else 1
        translation[word] = tuple(w.upper() for w in _pseudo_words(rng, n_out, (2, 3), taken))
    return ToyLexicon(tuple(nouns), tuple(verbs), tuple(adjectives), tuple(prepositions), translation)


def _noun_phrase(rng: random.Random, lex: ToyLexicon) -> Tuple[List[str], List[str]]:
    """Returns (source NP, target NP): ``the ADJ* NOUN`` -> ``the' NOUN' ADJ'*``."""
    adjectives = [rng.choice(lex.adjectives) for _ in range(rng.choice((0, 0, 1, 1, 2)))]
    noun = rng.choice(lex.nouns)
    source = ["the"] + adjectives + [noun]
    target_words = ["the", noun] + adjectives
    return source, target_words


def generate_pair(rng: random.Random, lex: ToyLexicon) -> Tuple[str, str]:
    """One sentence pair as whitespace-tokenised strings (source, target)."""
    subject, subject_t = _noun_phrase(rng, lex)
    obj, obj_t = _noun_phrase(rng, lex)
    verb = rng.choice(lex.verbs)
    source = subject + [verb] + obj
    target_order = subject_t + obj_t + [verb]
    if rng.random() < 0.5:
        prep = rng.choice(lex.prepositions)
        pp, pp_t = _noun_phrase(rng, lex)
        source += [prep] + pp
        target_order += [prep] + pp_t
    target = [t for word in target_order for t in lex.translation[word]]
    return " ".join(source), " ".join(target)


def generate_corpus(n_pairs: int, seed: int, lexicon_seed: int = 1) -> List[Tuple[str, str]]:
    """``n_pairs`` sentence pairs; the lexicon is shared between splits via ``lexicon_seed``."""
    lex = build_lexicon(lexicon_seed)
    rng = random.Random(seed)
    return [generate_pair(rng, lex) for _ in range(n_pairs)]


SPLITS = {"train": (12000, 11), "valid": (500, 12), "test": (500, 13)}


def write_toy_corpus(out_dir: Path, src: str = "src", tgt: str = "tgt", splits=None) -> Dict[str, int]:
    """Writes ``{split}.{src,tgt}`` text files into ``out_dir``; returns lines per split.

    Existing identical files are left as they are; existing different files are an error
    (nothing is overwritten silently).
    """
    splits = splits or SPLITS
    return write_pairs(out_dir, {split: generate_corpus(n, seed) for split, (n, seed) in splits.items()}, src, tgt)


def write_pairs(out_dir: Path, pairs: Dict[str, List[Tuple[str, str]]], src: str = "src",
                tgt: str = "tgt") -> Dict[str, int]:
    """Writes ``{split}.{src,tgt}`` for ``{split: [(source, target), ...]}``; returns lines per split.

    Raises:
        FileExistsError: if a file exists with other content (nothing is overwritten).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {out_dir / f"{split}.{lang}": "".join(pair[side] + "\n" for pair in split_pairs)
             for split, split_pairs in pairs.items() for side, lang in ((0, src), (1, tgt))}
    for path, text in texts.items():  # check everything before writing anything
        if path.exists() and path.read_text() != text:
            raise FileExistsError(f"{path} exists with different content; remove it or use another --out")
    for path, text in texts.items():
        if not path.exists():
            path.write_text(text)
    return {split: len(split_pairs) for split, split_pairs in pairs.items()}
