"""The incremental save a save path asks for, as it hands it to its save session: the one
wiring of the single-process save, the multi-rank save and ``flashwrite.dcp``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..format import Manifest
from ..targets.target import Target
from .link import BaseCache, Planner


@dataclass(frozen=True)
class Wiring:
    """An incremental save asked for, as every save path hands it to its save session
    (``SaveSession.stage``): the Writer's base cache and copy threads, how the base is seen
    (``view``, see ``Planner``), or why it cannot apply to this save (``refused``: the
    save writes every stripe, and ``SaveStats.incremental`` says so). ``rank``: the
    (rank, world size) a save that drives its own ranks plans for (``flashwrite.dcp``,
    whose sessions are single-rank); other saves plan for their session's rank."""

    cache: BaseCache | None
    threads: int = 1
    view: Callable[[Manifest], Manifest | str] | None = None
    refused: str = ""
    rank: tuple[int, int] | None = None

    @classmethod
    def refuse(cls, why: str) -> "Wiring":
        return cls(None, refused=why)

    def planner(self, final: str, target: Target, rank: tuple[int, int] | None) -> Callable[[str], Planner] | None:
        """What the session calls with its temporary directory, once made: the save's Planner
        (of rank ``rank`` = (rank, world size) in a multi-rank save); None where refused."""
        if self.refused or self.cache is None:
            return None
        rank = self.rank if self.rank is not None else rank
        return lambda tmp: Planner(final, tmp, self.cache, self.threads, target, rank, self.view)
