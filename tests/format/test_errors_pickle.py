"""flashwrite's errors survive pickling with their fields: DCP gathers each rank's error
and ships it to every rank (a ChecksumMismatchError raised on one rank of a DCP load
failed to unpickle on the others, hiding the real error behind a TypeError)."""

from __future__ import annotations

import pickle

import pytest

import flashwrite as fw
from flashwrite import errors

CASES = [
    errors.CorruptCheckpointError("bad", file="model-00001-of-00002.safetensors", tensor="w"),
    errors.ChecksumMismatchError("sum", file="f", tensor="w", offset=4096, expected="00ff", actual="ff00"),
    errors.UnsafeCheckpointError("unsafe", file="f"),
    errors.CheckpointExistsError("exists"),
    errors.DistributedSaveError("rank 1 failed", {1: "ENOSPC"}),
    errors.DivergedReplicasError("diverged", [{"tensor": "w", "piece": [0, 8], "digests": {"aa": [0]},
                                               "majority": None}]),
    errors.DistributedLoadError("lost a peer"),
]


@pytest.mark.parametrize("err", CASES, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_fields(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    assert back.__dict__ == err.__dict__
    assert isinstance(back, fw.FlashwriteError)
