"""The main job's generated language pair: long sentences on which search matters (no download).

A deterministic grammar (from ``lexicon_seed``) with sampled choices (from each split's seed)
translates an English-like SVO source language into a verb-final target language with
agreement. What a model has to learn, and what makes decoding hard:

Source grammar::

    sentence := [ADVERB] clause (CONJ clause){0,2} "."         (15 to 40 tokens: resampled)
    clause   := NP VERB NP [PP]
    NP       := "the" ADJ{0,2} NOUN ["s"] ["of" NAME] ["that" VERB NP']   (NP': no relative clause)
    PP       := PREP NP'

Target grammar (per clause)::

    clause'  := NP' NP' [PP'] VERB'                              (verb-final: SVO -> SOV)
    NP'      := DET[g, n] NOUN'[n] ADJ'[g, n]* ["DI" NAME'] [REL NP' VERB'[g, n]]
    PP'      := PREP'[g] NP'

* **Long-range reordering and agreement**: the verb moves behind the object and the
  prepositional phrase (with relative clauses, 10-20 tokens) and agrees in gender and number
  with the subject, which the target emitted long before. Adjectives follow their noun and
  agree with it; determiners agree with their noun.
* **Lexical choices resolved only by later source words**: a source verb has two
  translations, chosen by the animacy of its object (which follows the verb in the source);
  a preposition has two, chosen by the gender of its noun (which follows it in both
  languages, so the decoder must attend ahead of the word it translates).
* **Many-to-one and one-to-many**: ``NOUN s`` (plural) is one target token; one noun in eight
  translates into two target tokens.
* **Rare words** (what keeps a small model below the pair's ceiling, and learning slowly): an
  NP has "of NAME" with probability 0.35 (about two names a sentence); the 1,500 names follow
  Zipf's law (the name of rank r has weight 1/r) and each has one arbitrary target word, so a
  name is translated only once the model has seen it often enough: in the 8,000 training
  sentences a quarter of the test set's names occur fewer than 10 times, some never. Teacher
  forcing with the demo model reaches valid BLEU of about 50 and stays there (loss plateau)
  while the same model learns the grammar without names to the noise ceiling (about 85).
* **Noise** (irreducible, which keeps BLEU far from 100):

  - 40% of the nouns have a synonym, used in 30% of their occurrences;
  - the sentence adverb (in 70% of the sentences) has one two-token translation (probability
    0.4) and three three-token translations that share their first token (0.2 each). Greedy
    decoding takes the shared first token (0.6) and then guesses one of three (0.2); beam
    search finds the most likely translation (0.4): this is where beam search beats greedy;
  - with probability 0.05 a clause gets an optional particle after its verb.

Every word is a generated pseudo-word (target words upper case, so copying never helps).
"""

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .toy_language_pair import write_pairs

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
#: Agreement suffixes of target adjectives, determiners and verbs: (gender, number) -> suffix.
_SUFFIX = {("m", "sg"): "O", ("f", "sg"): "A", ("m", "pl"): "OS", ("f", "pl"): "AS"}
#: Source sentence length bounds (tokens, the final "." included).
MIN_LENGTH, MAX_LENGTH = 15, 40


@dataclass(frozen=True)
class Noun:
    source: str
    gender: str  # "m" | "f"
    animate: bool
    singular: Tuple[str, ...]  # target tokens
    plural: Tuple[str, ...]
    synonym: Tuple[Tuple[str, ...], Tuple[str, ...]] = ()  # (singular, plural) of the synonym, or ()


@dataclass(frozen=True)
class DemoLexicon:
    """Source words and their target forms."""

    nouns: Tuple[Noun, ...]
    verbs: Dict[str, Tuple[str, str]]  # source -> (target stem, animate object; inanimate object)
    adjectives: Dict[str, str]  # source -> target stem
    prepositions: Dict[str, Tuple[str, str]]  # source -> (before a masculine; feminine noun)
    adverbs: Dict[str, Tuple[Tuple[str, ...], Tuple[Tuple[str, ...], ...]]]  # -> (mode, three variants)
    conjunctions: Dict[str, str]
    particle: str
    relative: str
    names: Tuple[Tuple[str, str], ...] = ()  # (source, target), most frequent first (Zipf weights)
    name_weights: Tuple[float, ...] = ()  # cumulative
    name_rate: float = 0.0  # probability that an NP gets "of NAME"


def _pseudo_words(rng: random.Random, count: int, syllables: Sequence[int], taken: set) -> List[str]:
    words = []
    while len(words) < count:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice(syllables)))
        if word not in taken and word.upper() not in taken:
            taken.update((word, word.upper()))
            words.append(word)
    return words


def build_demo_lexicon(seed: int = 1, n_nouns: int = 60, n_verbs: int = 20, n_adjectives: int = 20,
                       n_prepositions: int = 6, n_adverbs: int = 4, n_names: int = 1500, name_exponent: float = 1.0,
                       name_rate: float = 0.35) -> DemoLexicon:
    """The vocabulary and its translations, deterministically from ``seed``.

    ``n_names`` names with Zipf weights ``rank ** -name_exponent``, attached to a noun phrase with
    probability ``name_rate`` (``n_names=0``: the pair without rare words). The names are drawn
    after every other word, so the rest of the lexicon does not depend on them.
    """
    rng = random.Random(seed)
    taken = {"the", "that", "s", "of"}

    def target(n=1):
        return tuple(w.upper() for w in _pseudo_words(rng, n, (2, 3), taken))

    nouns = []
    for word in _pseudo_words(rng, n_nouns, (2, 3), taken):
        n_out = 2 if rng.random() < 0.125 else 1
        singular = target(n_out)
        plural = singular[:-1] + (singular[-1] + "N",)  # the plural marks the last token
        synonym = ()
        if rng.random() < 0.4:
            syn = target(1)
            synonym = (syn, (syn[0] + "N",))
        nouns.append(Noun(word, rng.choice("mf"), rng.random() < 0.4, singular, plural, synonym))
    verbs = {w: (target()[0], target()[0]) for w in _pseudo_words(rng, n_verbs, (2, 3), taken)}
    adjectives = {w: target()[0] for w in _pseudo_words(rng, n_adjectives, (2,), taken)}
    prepositions = {w: (target()[0], target()[0]) for w in _pseudo_words(rng, n_prepositions, (1,), taken)}
    adverbs = {}
    for word in _pseudo_words(rng, n_adverbs, (2, 3), taken):
        shared = target()[0]
        adverbs[word] = (target(2), tuple((shared, *target(2)) for _ in range(3)))
    conjunctions = {w: target()[0] for w in _pseudo_words(rng, 2, (1,), taken)}
    particle, relative = target()[0], target()[0]
    # names last, so that the rest of the lexicon does not depend on them
    names = tuple((w, target()[0]) for w in _pseudo_words(rng, n_names, (3, 4), taken))
    weights, total = [], 0.0
    for rank in range(1, n_names + 1):
        total += rank ** -name_exponent
        weights.append(total)
    return DemoLexicon(tuple(nouns), verbs, adjectives, prepositions, adverbs, conjunctions,
                       particle=particle, relative=relative, names=names, name_weights=tuple(weights),
                       name_rate=name_rate if names else 0.0)


class _Sentence:
    """Builds one source/target pair from a shared random stream."""

    def __init__(self, rng: random.Random, lex: DemoLexicon):
        self.rng, self.lex = rng, lex

    def noun_phrase(self, relative: bool) -> Tuple[List[str], List[str], Noun, str]:
        """``(source, target, noun, number)`` of one NP (with a relative clause if ``relative``)."""
        rng, lex = self.rng, self.lex
        noun = rng.choice(lex.nouns)
        number = "pl" if rng.random() < 0.3 else "sg"
        adjectives = rng.sample(sorted(lex.adjectives), rng.choice((0, 0, 1, 1, 2)))
        source = ["the", *adjectives, noun.source] + (["s"] if number == "pl" else [])
        forms = noun.plural if number == "pl" else noun.singular
        if noun.synonym and rng.random() < 0.3:
            forms = noun.synonym[1] if number == "pl" else noun.synonym[0]
        agree = _SUFFIX[(noun.gender, number)]
        target = ["DE" + agree, *forms, *(lex.adjectives[a] + agree for a in adjectives)]
        if lex.name_rate and rng.random() < lex.name_rate:
            name, name_target = rng.choices(lex.names, cum_weights=lex.name_weights)[0]
            source += ["of", name]
            target += ["DI", name_target]
        if relative and rng.random() < 0.25:
            verb = rng.choice(sorted(lex.verbs))
            obj_source, obj_target, obj, _ = self.noun_phrase(relative=False)
            source += ["that", verb, *obj_source]
            target += [lex.relative, *obj_target, self.verb_form(verb, obj, noun.gender, number)]
        return source, target, noun, number

    def verb_form(self, verb: str, obj: Noun, gender: str, number: str) -> str:
        animate_stem, inanimate_stem = self.lex.verbs[verb]
        return (animate_stem if obj.animate else inanimate_stem) + _SUFFIX[(gender, number)]

    def clause(self) -> Tuple[List[str], List[str]]:
        rng, lex = self.rng, self.lex
        subj_source, subj_target, subj, subj_number = self.noun_phrase(relative=True)
        verb = rng.choice(sorted(lex.verbs))
        obj_source, obj_target, obj, _ = self.noun_phrase(relative=True)
        source = subj_source + [verb] + obj_source
        target = subj_target + obj_target
        if rng.random() < 0.5:
            prep = rng.choice(sorted(lex.prepositions))
            pp_source, pp_target, pp_noun, _ = self.noun_phrase(relative=False)
            source += [prep, *pp_source]
            target += [lex.prepositions[prep][pp_noun.gender == "f"], *pp_target]
        target.append(self.verb_form(verb, obj, subj.gender, subj_number))
        if rng.random() < 0.05:
            target.append(lex.particle)
        return source, target

    def pair(self) -> Tuple[List[str], List[str]]:
        rng, lex = self.rng, self.lex
        source, target = [], []
        if rng.random() < 0.7:
            adverb = rng.choice(sorted(lex.adverbs))
            mode, variants = lex.adverbs[adverb]
            source.append(adverb)
            target += list(mode if rng.random() < 0.4 else rng.choice(variants))
        for i in range(rng.choice((1, 2, 2, 3))):
            if i:
                conj = rng.choice(sorted(lex.conjunctions))
                source.append(conj)
                target.append(lex.conjunctions[conj])
            clause_source, clause_target = self.clause()
            source += clause_source
            target += clause_target
        return source + ["."], target + ["."]


def generate_demo_pair(rng: random.Random, lex: DemoLexicon) -> Tuple[str, str]:
    """One sentence pair (source, target), whitespace-tokenised, the source 15 to 40 tokens long."""
    while True:  # rejection keeps the length distribution simple to state
        source, target = _Sentence(rng, lex).pair()
        if MIN_LENGTH <= len(source) <= MAX_LENGTH:
            return " ".join(source), " ".join(target)


def generate_demo_corpus(n_pairs: int, seed: int, lexicon_seed: int = 1) -> List[Tuple[str, str]]:
    """``n_pairs`` sentence pairs; the lexicon is shared between splits via ``lexicon_seed``."""
    lex = build_demo_lexicon(lexicon_seed)
    rng = random.Random(seed)
    return [generate_demo_pair(rng, lex) for _ in range(n_pairs)]


DEMO_SPLITS = {"train": (8000, 21), "valid": (400, 22), "test": (500, 23)}


def write_demo_corpus(out_dir: Path, src: str = "src", tgt: str = "tgt", splits=None) -> Dict[str, int]:
    """Writes ``{split}.{src,tgt}`` into ``out_dir`` (identical files are kept, different ones refused)."""
    splits = splits or DEMO_SPLITS
    return write_pairs(out_dir, {split: generate_demo_corpus(n, seed) for split, (n, seed) in splits.items()},
                       src, tgt)
