"""The experiments around the plugin: running fairseq's tools with this package as ``--user-dir``
(:mod:`.fairseq_commands`), scoring checkpoints with sacrebleu and the paired bootstrap
(:mod:`.scoring`), the beam-search training ablation (configs, runner, report, curves and the
comparison with a published run: ``ablation_*``, :mod:`.reference_comparison`), what the training
benchmarks share (:mod:`.bench_harness`) and the attention of a checkpoint's model on a sentence
pair (:mod:`.attention_maps`). The commands in :mod:`fairseq_softtopk.cli` and the scripts under
``scripts/`` use them; ``import fairseq_softtopk`` (fairseq's ``--user-dir``) does not import this
subpackage, which stays out of training.
"""
