"""nn.Modules built on :mod:`fairseq_softtopk.ops` (no fairseq registration here)."""
