"""``torch.distributed.checkpoint`` (DCP) storage backed by flashwrite's engine.

    import torch.distributed.checkpoint as dcp
    from flashwrite.dcp import FlashwriteStorageWriter, FlashwriteStorageReader

    dcp.save(state_dict, storage_writer=FlashwriteStorageWriter(path))
    fut = dcp.async_save(state_dict, storage_writer=FlashwriteStorageWriter(path))
    dcp.load(state_dict, storage_reader=FlashwriteStorageReader(path))   # reshards as DCP does

What lands on disk is a flashwrite checkpoint (format version 1): every rank's
tensor chunks are safetensors stripes written by the native engine
(``model-rank00001-00001-of-00004.safetensors``, keys ``fqn`` or, for a shard that
does not start at the origin, ``fqn@row_col``); objects DCP serialises to bytes
(non-tensor values) are kept inline in the manifest; DCP's metadata is a typed
JSON ``dcp`` section of ``flashwrite.json``, so reading a checkpoint never
unpickles anything by itself (DCP's own planner still ``torch.load``s the
byte items it asked for). The checkpoint is committed like any flashwrite
checkpoint: written into a temporary sibling directory, manifest last, renamed
into place by the coordinator in ``finish``; ``flashwrite.verify`` and
``flashwrite.load`` (a flat ``{key: tensor or bytes}``) work on it too.

Staging for ``dcp.async_save``: the writer is DCP's ``AsyncStager``. When it was
created with its path, ``stage()`` plans this rank's part of the checkpoint with
DCP's default planner, agrees with the other ranks (one small exchange on
flashwrite's gloo group) which rank writes each replicated item, and starts the
native save of exactly those chunks: it returns once they are copied into the
reusable staging pool (``Writer.save_async(block=True)`` semantics) while the
writes continue; the background ``dcp.save`` then only waits for them and
commits. Without a path (``checkpoint_id=`` given to ``async_save``) the state is
copied to cached host buffers instead and written from there. Use the default
planner and the thread executor with ``async_save`` (the process executor is refused
at the call); one save at a time per writer instance.

DCP's contract (``contract``): ``overwrite=True`` by default, as ``FileSystemWriter``,
replacing the checkpoint atomically; ``overwrite=False`` refuses a checkpoint with
DCP's own "Checkpoint already exists" error and writes into an empty directory.

Incremental saves: with a ``Writer(incremental=True)`` (or
``FlashwriteStorageWriter(path, incremental=True)``) each rank hard-links the stripes of
its items that did not change since the newest committed DCP checkpoint beside the
target, saved by as many ranks, and writes the rest (``flashwrite.incremental``; local
paths; ``last_stats.incremental`` says what happened). A replicated item is written by
the same rank at every save while the items stay the same (``stage()``'s owners and DCP's
dedup follow one deterministic rule), so that rank finds it in its own part of the base;
GPU tensors, another world size or a base that is not such a DCP checkpoint: written.

Layout: ``writer`` (the StorageWriter/AsyncStager), ``reader`` (the
StorageReader), ``section`` (the manifest's ``dcp`` section and the per-item
storage data), ``contract`` (where DCP's rules replace flashwrite's: overwrite, executor).
"""

from .reader import FlashwriteStorageReader
from .writer import FlashwriteStorageWriter

__all__ = ["FlashwriteStorageWriter", "FlashwriteStorageReader"]
