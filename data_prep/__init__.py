"""Data preparation for fairseq-softtopk: WMT14 En-Fr, WMT16 En-De and Multi30k.

The shell scripts next to this file (``prepare_*.sh``) run the stages; the work is done by the
small modules here, through ``python -m data_prep.cli``:

- :mod:`data_prep.state`: finished-step markers, atomic outputs, :class:`PrepError`;
- :mod:`data_prep.fetch`: resumable downloads, checksums, archive checks, corpus extraction;
- :mod:`data_prep.text`: punctuation normalisation + tokenisation in parallel, cleaning;
- :mod:`data_prep.bpe`: joint BPE with subword-nmt or sentencepiece;
- :mod:`data_prep.binarize`: ``fairseq-preprocess --joined-dictionary`` and its count checks.

Nothing is imported here, so that ``python -m data_prep.cli`` stays quick to start.
"""
