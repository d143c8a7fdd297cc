"""The package's command-line entry points, console scripts declared in pyproject.toml: ``fairseq-softtopk-main-job``
(:mod:`.main_job`), ``fairseq-softtopk-ablation`` (:mod:`.ablation`), ``fairseq-softtopk-bleu`` (:mod:`.bleu`) and
``fairseq-softtopk-options`` (:mod:`.options`); each also runs as ``python -m fairseq_softtopk.cli.NAME``."""
