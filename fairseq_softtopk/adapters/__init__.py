"""Adapters of other frameworks' models to the search protocol (:class:`fairseq_softtopk.search.SearchDecoder`).
Each imports its framework on use: :mod:`.huggingface` (the ``[hf]`` extra)."""
