"""The cores this process runs on: what SSD's worker and the target share on one machine, and
the one object that pins them (CorePlacement)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def use_cores(cores: set[int], threads: int) -> None:
    """Runs torch on `threads` threads, pinned to `cores` where the OS allows it (Linux; not
    macOS, which has no affinity calls)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def usable_cores() -> set[int]:
    """The cores this process may run on: its affinity where the OS keeps one (Linux), else all."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


@dataclass
class CoreShare:
    """The cores and threads the target runs on: all of them for AR and SD, fewer for SSD
    where its draft worker holds one of this machine's cores."""
    all: tuple[set[int], int]
    ssd: tuple[set[int], int]

    @classmethod
    def of(cls, worker_cpus: str | None) -> CoreShare:
        everything = usable_cores(), torch.get_num_threads()
        if worker_cpus is None:  # the worker is elsewhere: SSD keeps every core
            return cls(everything, everything)
        rest = everything[0] - {int(c) for c in worker_cpus.split(",")}
        return cls(everything, (rest, max(1, min(everything[1], len(rest)))))

    @property
    def ratio(self) -> float:
        return self.all[1] / self.ssd[1]


class CorePlacement:
    """The one owner of this process's pinning while SSD's worker holds some of its cores: made
    where the worker's cores are chosen (saguaro.speculation.build), then asked for by the SSD
    proposer and by auto. It pins only where the process is not already where it should be,
    so an SSD round costs a look at the affinity, not a re-pin; a caller that moved the process
    meanwhile (a benchmark taking turns between methods) is still followed."""

    def __init__(self, share: CoreShare):
        self.share = share

    def for_ssd(self) -> None:
        """The target on the cores the worker leaves it."""
        self._pin(self.share.ssd)

    def for_all(self) -> None:
        """The target on all the cores: AR and SD rounds, and once SSD's worker is gone."""
        self._pin(self.share.all)

    @staticmethod
    def _pin(where: tuple[set[int], int]) -> None:
        cores, threads = where
        pinned = not hasattr(os, "sched_getaffinity") or os.sched_getaffinity(0) == cores
        if not pinned or torch.get_num_threads() != threads:
            use_cores(cores, threads)
