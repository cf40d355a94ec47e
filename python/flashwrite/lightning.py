"""A Lightning ``CheckpointIO`` that saves with flashwrite: training goes on once staged.

    from flashwrite.lightning import FlashwriteCheckpointIO
    trainer = Trainer(plugins=[FlashwriteCheckpointIO()],
                      callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Each Lightning checkpoint path (``epoch=0-step=5.ckpt``) becomes a flashwrite checkpoint
directory. Saves are asynchronous: ``save_checkpoint`` returns once the state is copied
into flashwrite's staging memory, at most one save is in flight (the next save, a load,
a removal and ``teardown()`` wait for it), and a save that failed is raised by the next
of those calls. Lightning's checkpoint dict holds tensors, plain values and Lightning's
``AttributeDict`` hyper-parameters, all stored without pickle; anything else needs
``allow_pickle=True`` (which loading then needs too: it executes code).

``LitModel.load_from_checkpoint(path)`` does not go through the plug-in (Lightning calls
``torch.load`` on the path itself, which fails on a directory): ``Trainer.fit``,
``validate``, ``test`` and ``predict`` with ``ckpt_path=`` do, and
``load_from_checkpoint(LitModel, path)`` here builds the module from a flashwrite
checkpoint the way ``LitModel.load_from_checkpoint`` would.

Works with ``lightning.pytorch`` or ``pytorch_lightning``, whichever is installed
(``pip install flashwrite[lightning]``). Under DDP, Lightning hands the full state to
global rank 0 only, which saves it. Strategies that save sharded state themselves
(FSDP with ``state_dict_type="sharded"``) write through torch.distributed.checkpoint;
pass ``flashwrite.dcp.FlashwriteStorageWriter`` there.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
from typing import Any, Callable

from . import SaveFuture, Writer, load
from .format import MANIFEST_NAME

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.data import AttributeDict
except ImportError:  # the standalone package
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
        from lightning_fabric.utilities.data import AttributeDict
    except ImportError as e:
        raise ImportError("flashwrite.lightning needs Lightning: pip install 'flashwrite[lightning]' "
                          "(lightning or pytorch_lightning)") from e

__all__ = ["FlashwriteCheckpointIO", "load_from_checkpoint"]


def _plain(x: Any) -> Any:
    """Lightning's AttributeDict (hyper-parameters) as the plain dict it is, recursively;
    Lightning reads hyper-parameters back as a mapping, so nothing needs pickle for them."""
    if isinstance(x, AttributeDict):
        return {k: _plain(v) for k, v in x.items()}
    if type(x) is dict:
        return {k: _plain(v) for k, v in x.items()}
    if type(x) is list:
        return [_plain(v) for v in x]
    if type(x) is tuple:
        return tuple(_plain(v) for v in x)
    return x


class FlashwriteCheckpointIO(CheckpointIO):
    """Lightning checkpoints written by flashwrite, asynchronously.

    writer_options: flashwrite ``Writer`` settings (stripes, queue_depth, chunk_bytes,
    backend, direct, max_staging_bytes); one Writer (one staging pool) serves every save.
    allow_pickle: store (and load) values that are not tensors or plain data by pickling.
    verify: check every byte against its checksum on load.
    """

    def __init__(self, *, allow_pickle: bool = False, verify: bool = True, **writer_options: Any) -> None:
        self.allow_pickle = allow_pickle
        self.verify = verify
        self._writer_options = writer_options
        self._writer: Writer | None = None
        self._pending: SaveFuture | None = None
        self._pending_path: str | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    # -- the in-flight save ------------------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for the save in flight; raise its failure (once)."""
        with self._lock:
            fut, self._pending, self._pending_path = self._pending, None, None
        if fut is not None:
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, with every other failure
                self._error = e
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait(self) -> None:
        """Block until the last save is durable and committed (raising its failure)."""
        self._settle()

    # -- CheckpointIO ------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; pass Writer settings to its constructor")
        self._settle()  # at most one save in flight, and the last one's failure surfaces here
        if self._writer is None:
            self._writer = Writer(**self._writer_options)
        target = os.path.abspath(os.fspath(path))
        fut = self._writer.save_async(_plain(checkpoint), target, overwrite=True, allow_pickle=self.allow_pickle)
        with self._lock:
            self._pending, self._pending_path = fut, target

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self._settle()
        target = os.fspath(path)
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        # Lightning's default map_location is a callable (storage, loc) -> storage: keep tensors where saved.
        location: Any = None if map_location is None or isinstance(map_location, Callable) else map_location
        allow = self.allow_pickle and weights_only is not True
        return load(target, map_location=location, verify=self.verify, allow_pickle=allow)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a flashwrite checkpoint (after its save, if still in flight, has finished).
        Anything that is not a flashwrite checkpoint is left alone."""
        target = os.path.abspath(os.fspath(path))
        with self._lock:
            in_flight = self._pending_path == target
        if in_flight:
            self._settle()
        if not os.path.lexists(target):
            return
        if os.path.isdir(target) and not os.path.islink(target) and \
                os.path.isfile(os.path.join(target, MANIFEST_NAME)):
            shutil.rmtree(target)
            return
        raise ValueError(f"{target} is not a flashwrite checkpoint; {type(self).__name__} removes only its own")

    def teardown(self) -> None:
        """Wait for the save in flight and free the staging memory (Lightning calls this at the end of fit)."""
        try:
            self._settle()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def load_from_checkpoint(cls: Any, path: Any, *, allow_pickle: bool = False, verify: bool = True,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a flashwrite checkpoint directory
    (a ``LightningModule`` or ``LightningDataModule`` class): the checkpoint is loaded by
    flashwrite, then handed to Lightning's own ``load_from_checkpoint`` as an in-memory
    file, so hyper-parameters, ``strict``, ``map_location`` and the module's
    ``on_load_checkpoint`` behave exactly as they do for a ``.ckpt`` file. It holds the
    state twice in host memory while it runs (the serialised copy is dropped after).
    allow_pickle: for checkpoints saved with ``FlashwriteCheckpointIO(allow_pickle=True)``
    (executes code: only for trusted checkpoints)."""
    import torch
    checkpoint = load(os.fspath(path), map_location="cpu", verify=verify, allow_pickle=allow_pickle)
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    del checkpoint
    buf.seek(0)
    if allow_pickle:
        kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buf, **kwargs)
