"""A run resumed in a later epoch gets the training batches of the run never stopped.

fairseq builds the training batches once, when the training iterator is created, grouping sentences of equal
length in an order drawn with the seed plus *that* epoch (``FairseqTask.get_batch_iterator``: ``numpy_seed(seed +
epoch)``), and reuses them in every later epoch (shuffled per epoch). A run trained in one go creates the iterator
in epoch 1; a run resumed in epoch 2 or later creates it there and gets other batches from then on. The updates
then differ from the run never stopped: a Multi30k beam-search fine-tuning run resumed at the end of its first
epoch logged other losses from its first update on.

:func:`install` makes ``FairseqTask.get_batch_iterator`` build such reused batches as in epoch 1 whatever epoch asks
for them (the iterator still starts at, and shuffles for, the epoch asked for), so that a resumed run gets the
batches of the run trained in one go from epoch 1, which fairseq's resume otherwise reproduces (the data
iterator's place, the random state of every update). Iterators that are not reused across epochs (``--rebuild-
batches``, ``--update-epoch-batch-itr``, sharded data, a disabled cache) are built per epoch in any run, so
resuming already matches them: they are left as fairseq builds them. Tasks that override ``get_batch_iterator``
are not changed.
"""

import inspect

_PATCHED = "_softtopk_resumed_batches"


def install() -> None:
    """Wraps ``FairseqTask.get_batch_iterator`` (see the module); idempotent."""
    from fairseq.tasks.fairseq_task import FairseqTask

    original = FairseqTask.get_batch_iterator
    if getattr(original, _PATCHED, False):
        return
    signature = inspect.signature(original)

    def get_batch_iterator(self, dataset, *args, **kwargs):
        call = signature.bind(self, dataset, *args, **kwargs)
        call.apply_defaults()
        arguments = dict(call.arguments)
        epoch = arguments["epoch"]
        reused = (not arguments["disable_iterator_cache"] and not arguments["update_epoch_batch_itr"]
                  and not getattr(self.cfg, "rebuild_batches", False) and self.can_reuse_epoch_itr(dataset))
        if epoch <= 1 or not reused or dataset in self.dataset_to_epoch_iter:
            return original(**arguments)
        iterator = original(**{**arguments, "epoch": 1})  # the batches of a run that began in epoch 1
        iterator.epoch = epoch
        dataset.set_epoch(epoch)
        return iterator

    setattr(get_batch_iterator, _PATCHED, True)
    get_batch_iterator.__doc__ = original.__doc__
    get_batch_iterator.__wrapped__ = original
    FairseqTask.get_batch_iterator = get_batch_iterator
