"""A Lightning ``CheckpointIO`` that saves with flashwrite: training goes on once staged.

    from flashwrite.lightning import FlashwriteCheckpointIO
    trainer = Trainer(plugins=[FlashwriteCheckpointIO()],
                      callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Each Lightning checkpoint path (``epoch=0-step=5.ckpt``) becomes a flashwrite checkpoint
directory. Saves are asynchronous: ``save_checkpoint`` returns once the state is copied
into flashwrite's staging memory, at most one save is in flight (the next save, a load,
a removal and ``teardown()`` wait for it), and a save that failed is raised by the next
of those calls. While a save to a new name is in flight the name already exists, as an
empty directory dated 1970 that the commit replaces atomically, so ``ModelCheckpoint``'s
``-vN`` versioning sees it taken (a crash leaves that empty directory; its date keeps
``ckpt_path="last"`` on a real checkpoint); another save of this process to a name in
flight is refused. Wrapped in Lightning's ``AsyncCheckpointIO`` (which it need not be: it
is asynchronous already), ``save_checkpoint`` runs on the wrapper's thread: the plug-in then
writes and commits the save before it returns and closes its Writer after it (a fresh
staging pool per save; the wrapper's teardown, the only one Lightning calls, leaves no
thread), and a removal waits for a save of its name that is staging or writing; one that
has not started (queued in the wrapper, its name not there yet) is removed once committed. Where Lightning
never calls ``teardown()`` (``trainer.save_checkpoint`` outside ``fit``) the Writer is closed,
after the save in flight, when the plug-in is garbage-collected or at interpreter exit, and a failure that no call
raised is then printed to stderr and logged. The plug-in pickles (``ddp_spawn``,
``torch.save(trainer)``): its Writer and save in flight stay in the process that made them.

Lightning's checkpoint dict holds tensors, plain values and Lightning's ``AttributeDict``
hyper-parameters, all stored without pickle; so are OmegaConf ``DictConfig``/``ListConfig``
values (Hydra configs): stored as plain containers with interpolations unresolved, and
restored as OmegaConf objects by this plug-in (plain containers where OmegaConf is not
installed, or when read by ``flashwrite.load``). Anything else needs ``allow_pickle=True``
(which loading then needs too: it executes code).

``LitModel.load_from_checkpoint(path)`` does not go through the plug-in (Lightning calls
``torch.load`` on the path itself, which fails on a directory): ``Trainer.fit``,
``validate``, ``test`` and ``predict`` with ``ckpt_path=`` do, and
``load_from_checkpoint(LitModel, path)`` here builds the module from a flashwrite
checkpoint the way ``LitModel.load_from_checkpoint`` would.

Works with ``lightning.pytorch`` and ``pytorch_lightning`` Trainers, one or both installed
(``pip install flashwrite[lightning]``): the plug-in is a ``CheckpointIO`` of each. Under DDP, Lightning hands the full state to
global rank 0 only, which saves it. Strategies that save sharded state themselves
(FSDP with ``state_dict_type="sharded"``) write through torch.distributed.checkpoint;
pass ``flashwrite.dcp.FlashwriteStorageWriter`` there.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import shutil
import sys
import threading
import weakref
from typing import Any, Callable

from .. import SaveFuture, Writer, load
from ..errors import CheckpointExistsError
from ..format import MANIFEST_NAME


def _lightning_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Lightning's ``CheckpointIO`` and ``AttributeDict`` classes under every name installed:
    ``lightning.fabric`` (the ``lightning`` package) and ``lightning_fabric`` (under
    ``pytorch_lightning``) are two copies of one code, and each Trainer accepts only plug-ins
    of its own copy's class ("Found invalid type for plugin"), so the plug-in derives from both."""
    ios: list[type] = []
    dicts: list[type] = []
    for pkg in ("lightning.fabric", "lightning_fabric"):
        try:
            io_mod = importlib.import_module(f"{pkg}.plugins.io.checkpoint_io")
            data_mod = importlib.import_module(f"{pkg}.utilities.data")
        except ImportError:
            continue
        ios.append(io_mod.CheckpointIO)
        dicts.append(data_mod.AttributeDict)
    if not ios:
        raise ImportError("flashwrite.lightning needs Lightning: pip install 'flashwrite[lightning]' "
                          "(lightning or pytorch_lightning)")
    return tuple(ios), tuple(dicts)


_CHECKPOINT_IOS, _ATTRIBUTE_DICTS = _lightning_types()

__all__ = ["FlashwriteCheckpointIO", "load_from_checkpoint"]

log = logging.getLogger("flashwrite")

# The checkpoint key that says which values were OmegaConf objects: [[kind, [key, ...]], ...],
# kind "DictConfig", "ListConfig" or "class" (an OmegaConf class, Lightning's hyper_parameters_type).
OMEGACONF_KEY = "_flashwrite_omegaconf"


# ------------------------------------------------------------------ the checkpoint dict, stored without pickle


def _plain(x: Any, path: tuple = (), found: list | None = None) -> Any:
    """Lightning's AttributeDict (hyper-parameters) as the plain dict it is, and OmegaConf
    objects as plain containers (their places noted in ``found``), recursively."""
    if isinstance(x, _ATTRIBUTE_DICTS) or type(x) is dict:
        return {k: _plain(v, (*path, k), found) for k, v in x.items()}
    if type(x) is list:
        return [_plain(v, (*path, i), found) for i, v in enumerate(x)]
    if type(x) is tuple:
        return tuple(_plain(v) for v in x)  # not noted inside tuples: an OmegaConf object there needs pickle
    oc = sys.modules.get("omegaconf")  # an OmegaConf object exists only once omegaconf is imported
    if oc is not None and found is not None:
        if isinstance(x, oc.Container):
            found.append([type(x).__name__, list(path)])
            return oc.OmegaConf.to_container(x, resolve=False)  # interpolations kept, as pickling keeps them
        if isinstance(x, type) and issubclass(x, oc.Container) and getattr(oc, x.__name__, None) is x:
            found.append(["class", list(path)])
            return f"omegaconf.{x.__name__}"
    return x


def _to_store(checkpoint: Any) -> Any:
    found: list = []
    out = _plain(checkpoint, (), found)
    if found:
        if not isinstance(out, dict):
            raise TypeError("a Lightning checkpoint is a dict; this one is an OmegaConf object itself")
        out[OMEGACONF_KEY] = found
    return out


def _restore(checkpoint: Any) -> Any:
    """The OmegaConf objects ``_to_store`` turned into plain containers, back (where OmegaConf
    is installed; otherwise they stay plain, and an OmegaConf class stays its name)."""
    if not isinstance(checkpoint, dict) or OMEGACONF_KEY not in checkpoint:
        return checkpoint
    found = checkpoint.pop(OMEGACONF_KEY)
    try:
        import omegaconf
    except ImportError:
        return checkpoint
    for kind, path in found:
        try:
            parent = checkpoint
            for k in path[:-1]:
                parent = parent[k]
            value = parent[path[-1]]
            if kind == "class":
                new = getattr(omegaconf, str(value).partition(".")[2], None)
                if not (isinstance(new, type) and issubclass(new, omegaconf.Container)):
                    raise ValueError(f"{value!r} is not an OmegaConf container class")
            else:
                new = omegaconf.OmegaConf.create(value)
            parent[path[-1]] = new
        except (LookupError, TypeError, ValueError) as e:
            raise ValueError(f"the checkpoint's {OMEGACONF_KEY} names {path!r}, which it cannot restore: {e}") from e
    return checkpoint


# ------------------------------------------------------------------ names with a save in flight

# Checkpoint paths a save of this process is writing (until its plug-in has waited for it).
_in_flight: set[str] = set()
_in_flight_lock = threading.Lock()


def _claim(target: str) -> str | None:
    """Take ``target`` for a save: refused while another save of this process writes it; a
    new name is created at once as an empty directory (the commit replaces it atomically),
    dated 1970 so that Lightning's newest-"last" choice never prefers it. Returns it then."""
    with _in_flight_lock:
        if target in _in_flight:
            raise CheckpointExistsError(17, "another save of this process is writing this checkpoint (in flight)",
                                        target)
        _in_flight.add(target)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.mkdir(target)
    except FileExistsError:
        return None  # the save replaces what is there, if flashwrite may (a checkpoint, an empty directory)
    except BaseException:
        _unclaim(target, None)
        raise
    os.utime(target, (0, 0))
    return target


def _unclaim(target: str, placeholder: str | None) -> None:
    if placeholder is not None:
        try:
            os.rmdir(placeholder)  # only while it is still the empty directory _claim made
        except OSError:
            pass
    with _in_flight_lock:
        _in_flight.discard(target)


class _Saves:
    """What a plug-in owns in this process: its Writer, the save in flight and a failure
    not raised yet. Apart from the plug-in, so that its finalizer can close them."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.writer: Writer | None = None
        self.pending: tuple[SaveFuture, str, str | None] | None = None  # (future, path, placeholder)
        self.error: tuple[BaseException, str] | None = None
        self.saved: set[str] = set()  # real paths of the checkpoints it saved (links to them are its own)
        self.starting: set[str] = set()  # paths a save_checkpoint call is claiming or staging right now
        self.lock = threading.Lock()
        self.started = threading.Condition(self.lock)  # notified when a path leaves ``starting``
        self.home = threading.get_ident()  # the thread that made the plug-in (or unpickled it)
        self.wrapped = False  # a save ran on another thread (a wrapper's, e.g. AsyncCheckpointIO's)
        self.doomed: set[str] = set()  # paths removed before their queued save had started

    def settle(self) -> None:
        """Wait for the save in flight; raise its failure (once)."""
        with self.lock:
            pending, self.pending = self.pending, None
        if pending is not None:
            fut, target, placeholder = pending
            failed = False
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, with every other failure
                self.error, failed = (e, target), True
            finally:
                _unclaim(target, placeholder if failed else None)
        if self.error is not None:
            (err, _), self.error = self.error, None
            raise err

    def close(self) -> None:
        try:
            self.settle()
        finally:
            writer, self.writer = self.writer, None
            if writer is not None:
                writer.close()


def _release(saves: _Saves) -> None:
    """The plug-in is gone, or the interpreter exits, and nothing called ``teardown()``:
    close its Writer after the save in flight, and tell of a failure nobody raised."""
    target = saves.pending[1] if saves.pending is not None else saves.error[1] if saves.error else None
    try:
        saves.close()
    except BaseException as e:  # noqa: BLE001 - nobody is left to raise it to
        log.error("flashwrite.lightning: the checkpoint save to %s failed: %s", target, e)
        print(f"flashwrite: a Lightning checkpoint save to {target} failed and was never committed "
              f"(nothing waited for it): {e}", file=sys.stderr)


def _is_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST_NAME))


class FlashwriteCheckpointIO(*_CHECKPOINT_IOS):  # type: ignore[misc]
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
        self._start()

    def _start(self) -> None:
        self._saves = _Saves(self._writer_options)
        self._finalizer = weakref.finalize(self, _release, self._saves)

    # Pickled (ddp_spawn, torch.save(trainer)): the settings only; the Writer, the save in flight
    # and its failure stay with this process's plug-in, and the copy builds its own Writer.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_saves"], state["_finalizer"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start()

    def wait(self) -> None:
        """Block until the last save is durable and committed (raising its failure)."""
        self._saves.settle()

    # -- CheckpointIO ------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options; pass Writer settings to its constructor")
        saves = self._saves
        # Called on a thread other than the plug-in's own: somebody else made the save
        # asynchronous (Lightning's AsyncCheckpointIO runs it in its executor, and tears
        # down only that executor): it is written before this call returns, and the Writer
        # closed after it, so that the wrapper's teardown leaves no flashwrite thread.
        wrapped = threading.get_ident() != saves.home
        if wrapped:
            saves.wrapped = True
        saves.settle()  # at most one save in flight, and the last one's failure surfaces here
        state = _to_store(checkpoint)
        target = os.path.abspath(os.fspath(path))
        with saves.lock:
            saves.starting.add(target)
        try:
            if saves.writer is None:
                saves.writer = Writer(**saves.options)
            placeholder = _claim(target)
            try:
                fut = saves.writer.save_async(state, target, overwrite=True, allow_pickle=self.allow_pickle)
            except BaseException:
                _unclaim(target, placeholder)
                raise
            with saves.lock:
                saves.pending = (fut, target, placeholder)
                saves.saved.add(os.path.realpath(target))
            if wrapped:
                saves.close()  # the path stays "starting" until committed: a removal waits for it
                with saves.lock:
                    doomed = target in saves.doomed
                    saves.doomed.discard(target)
                if doomed:  # removed while this save was queued in the wrapper, before it started
                    shutil.rmtree(target)
        finally:
            with saves.lock:
                saves.starting.discard(target)
                saves.started.notify_all()

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self._saves.settle()
        target = os.fspath(path)
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        # Lightning's default map_location is a callable (storage, loc) -> storage: keep tensors where saved.
        location: Any = None if map_location is None or isinstance(map_location, Callable) else map_location
        allow = self.allow_pickle and weights_only is not True
        return _restore(load(target, map_location=location, verify=self.verify, allow_pickle=allow))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a flashwrite checkpoint (after its save, if still in flight, has finished), or
        a symbolic link to one or to a checkpoint this plug-in saved (``save_last="link"``):
        the link only. Anything else is left alone."""
        saves = self._saves
        target = os.path.abspath(os.fspath(path))
        with saves.lock:
            # A save of this path that has started but not yet handed its future over (the
            # name claimed, the state staging: under AsyncCheckpointIO, on another thread).
            saves.started.wait_for(lambda: target not in saves.starting)
            in_flight = saves.pending is not None and saves.pending[1] == target
            if saves.wrapped and not os.path.lexists(target):
                # Saves run on a wrapper's thread, queued there: Lightning removes only what it
                # saved, so this one is queued, not started; it is removed once committed.
                saves.doomed.add(target)
                return
        if in_flight:
            saves.settle()
        if not os.path.lexists(target):
            return
        if os.path.islink(target):
            dest = os.path.realpath(target)
            if dest in saves.saved or _is_checkpoint(dest):
                os.unlink(target)
                return
            raise ValueError(f"{target} links to {dest}, which is not a flashwrite checkpoint; "
                             f"{type(self).__name__} removes only its own")
        if _is_checkpoint(target):
            shutil.rmtree(target)
            return
        raise ValueError(f"{target} is not a flashwrite checkpoint; {type(self).__name__} removes only its own")

    def teardown(self) -> None:
        """Wait for the save in flight and free the staging memory (Lightning calls this at the end of fit)."""
        self._saves.close()


def load_from_checkpoint(cls: Any, path: Any, *, allow_pickle: bool = False, verify: bool = True,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a flashwrite checkpoint directory
    (a ``LightningModule`` or ``LightningDataModule`` class), in any process: the checkpoint
    is loaded by flashwrite, then handed to Lightning's own ``load_from_checkpoint`` as an
    in-memory file, so hyper-parameters (OmegaConf ones as ``DictConfig``), ``strict``,
    ``map_location`` and the module's ``on_load_checkpoint`` behave exactly as they do for
    a ``.ckpt`` file. It holds the state twice in host memory while it runs (the serialised
    copy is dropped after). allow_pickle: for checkpoints saved with
    ``FlashwriteCheckpointIO(allow_pickle=True)`` (executes code: only for trusted checkpoints)."""
    import torch
    checkpoint = _restore(load(os.fspath(path), map_location="cpu", verify=verify, allow_pickle=allow_pickle))
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    del checkpoint
    buf.seek(0)
    # The in-memory file holds only what flashwrite decoded (without pickle unless allow_pickle),
    # so reading it back with pickle runs nothing the checkpoint chose; DictConfig needs it.
    kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buf, **kwargs)
