"""The experiments around the plugin: running fairseq's tools with this package as ``--user-dir``
(:mod:`.fairseq_commands`), scoring checkpoints with sacrebleu (:mod:`.scoring`; fairseq-generate's run and
output: :mod:`.fairseq_generate`) and the paired bootstrap (:mod:`.paired_bootstrap`), the beam-search
training ablation (configs, runner, report, curves and the
comparison with a published run: ``ablation_*``, :mod:`.reference_comparison`), stopping and
resuming it safely (child processes that stop on a signal and die with the runner:
:mod:`.child_processes`; one process per run and work directory: :mod:`.run_lock`; checksums of finished
checkpoints: :mod:`.checkpoint_integrity`; the data a run trains on: :mod:`.run_data`; what a stop left: :mod:`.run_status`; finished runs kept without
checkpoints, to go on elsewhere: :mod:`.run_records`; what the main job
created, for ``--fresh``: :mod:`.work_dir_marker`), what the training
benchmarks share (:mod:`.bench_harness`; the training benchmark's measuring passes and tables:
:mod:`.bench_passes`, :mod:`.bench_train_tables`) and the attention of a checkpoint's model on a
sentence pair (:mod:`.attention_maps`). The commands in :mod:`fairseq_softtopk.cli` and the scripts under
``scripts/`` use them; ``import fairseq_softtopk`` (fairseq's ``--user-dir``) does not import this
subpackage, which stays out of training.
"""
