"""A GGUF model's repacked weights kept on disk: written on its first load, mapped on later ones.

Repacking a 1 GB file into saguaro's tiles costs 1.5-2 s on two cores, most of it the kernel
handing out and zeroing a gigabyte of fresh pages; mapping tiles that are already in the page
cache costs neither. The buffers a load asks saguaro's kernels for (repacked tiles, stacked
projections, dequantized rows) are handed out in the order asked; the first load keeps each
buffer's tag and bytes, and the next load of the same file, options and kernels gets the same
buffers back, filled, as long as it asks for the same tags in the same order (anything else
and it fills the rest itself). SAGUARO_WEIGHT_CACHE=0 turns this off; the folder keeps at most
SAGUARO_WEIGHT_CACHE_GB (default 16) GB, the least recently used models leaving first.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ALIGNMENT = 64
MIN_BYTES = 32 * 2**20  # smaller models load fast enough without a copy on disk
HUGE_PAGE = 2 * 2**20
SHARED_BLOCK = 32 * 2**20  # fresh_buffer's mappings for small buffers
_current: contextvars.ContextVar[WeightCache | None] = contextvars.ContextVar("weight_cache", default=None)


@dataclass
class WeightCache:
    """One load's buffers: replayed from `entry` where it holds them, else recorded."""
    entry: Path
    replay: list[tuple[str, int]] = field(default_factory=list)  # (tag, bytes) the entry holds
    mapped: np.ndarray | None = None
    recorded: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    offset: int = 0

    def take(self, tag: str, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A uint8 buffer of nbytes for `tag`, and whether it already holds the weights."""
        index = len(self.recorded)
        if self.mapped is not None and index < len(self.replay) and self.replay[index] == (tag, nbytes):
            buffer, filled = torch.from_numpy(self.mapped[self.offset:self.offset + nbytes]), True
        else:
            self.mapped, buffer, filled = None, fresh_buffer(nbytes), False
        self.offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        self.recorded.append((tag, buffer))
        return buffer, filled

    def replayed(self) -> bool:
        return self.mapped is not None and len(self.recorded) == len(self.replay)

    def pieces(self) -> Iterator[memoryview]:
        """The entry's bytes: each buffer, padded to ALIGNMENT."""
        for _, buffer in self.recorded:
            yield memoryview(buffer.numpy())
            yield memoryview(bytes(-buffer.numel() % ALIGNMENT))

    def write(self) -> None:
        """The recorded buffers as the folder's entry (written aside, then renamed into place)."""
        total = sum(-(-b.numel() // ALIGNMENT) * ALIGNMENT for _, b in self.recorded)
        if total < MIN_BYTES or shutil.disk_usage(self.entry.parent.parent).free < 2 * total:
            return
        staging = Path(tempfile.mkdtemp(dir=self.entry.parent.parent))
        try:
            with open(staging / "weights.bin", "wb") as f:
                write_in_blocks(f.fileno(), self.pieces())
            (staging / "manifest.json").write_text(json.dumps([[tag, b.numel()] for tag, b in self.recorded]))
        except OSError:  # a full disk: nothing half-written stays behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(self.entry, ignore_errors=True)
        try:
            staging.rename(self.entry)
        except OSError:  # another process wrote it first
            shutil.rmtree(staging, ignore_errors=True)


def write_in_blocks(fd: int, pieces: Iterable[memoryview]) -> None:
    """Writes the pieces one whole 2 MB block of the file per call: the page cache then holds
    the file in 2 MB folios, which later loads map as 2 MB pages (written piece by piece, the
    blocks where pieces meet stayed in small folios: a quarter of a 1 GB entry)."""
    batch: list[memoryview] = []
    filled = 0
    for piece in pieces:
        piece = piece.cast("B")
        while len(piece):
            part = piece[:HUGE_PAGE - filled]
            batch.append(part)
            filled += len(part)
            piece = piece[len(part):]
            if filled == HUGE_PAGE:
                write_all(fd, batch)
                batch, filled = [], 0
    write_all(fd, batch)


def write_all(fd: int, parts: list[memoryview]) -> None:
    """os.writev until every byte is written (it may write fewer than asked)."""
    while parts:
        written = os.writev(fd, parts[:512])  # within any system's IOV_MAX
        if written == 0:
            raise OSError(f"writev wrote nothing to fd {fd}")
        while parts and written >= len(parts[0]):
            written -= len(parts[0])
            parts = parts[1:]
        if parts and written:
            parts[0] = parts[0][written:]


def fresh_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of memory (not necessarily zeroed) on 2 MB pages where the kernel grants them
    (transparent huge pages, asked for per mapping): tiles stream faster from them, with no page
    walk every 4 KB and the prefetchers not stopping at each page's end (`tile_rows.py --pages
    2m,4k` measures it). Buffers under SHARED_BLOCK / 4 (a small model's projections) are carved
    one after another out of a shared mapping, as alone they would not fill one 2 MB page.

    Never an inference tensor, even when asked for inside torch.inference_mode: a shared block
    made there outlives that load, and a later load outside it that carves the block's rest
    (a draft's tiles, say) could not fill its buffers in place."""
    with torch.inference_mode(False):
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.empty(nbytes, dtype=torch.uint8)
        if nbytes >= SHARED_BLOCK // 4:
            return huge_mapping(nbytes)
        return _shared.carve(nbytes)


def huge_mapping(nbytes: int) -> torch.Tensor:
    """A mapping of its own, its whole 2 MB blocks asked for as 2 MB pages (the last partial
    block costs no more than it holds)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    start = -whole.data_ptr() % HUGE_PAGE  # untouched, the skipped head takes no memory
    with contextlib.suppress(OSError):  # a kernel without THP: 4 KB pages as before
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start:start + nbytes]


@dataclass
class SharedBlock:
    """Small buffers side by side in one mapping on 2 MB pages. A block lives while any of its
    buffers does, and the newest one also while it takes more (so at most 32 MB, of which only
    the pages touched take memory, outlive the buffers carved from it)."""
    block: torch.Tensor | None = None
    used: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def carve(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        with self.lock:
            if self.block is None or self.used + size > self.block.numel():
                self.block, self.used = huge_mapping(SHARED_BLOCK), 0
            buffer = self.block[self.used:self.used + nbytes]
            self.used += size
        return buffer


_shared = SharedBlock()


def enabled() -> bool:
    return os.environ.get("SAGUARO_WEIGHT_CACHE", "1") != "0"


def budget_bytes() -> int:
    return int(float(os.environ.get("SAGUARO_WEIGHT_CACHE_GB", "16")) * 2**30)


def open_entry(entry: Path) -> WeightCache:
    """The cache of `entry`: replaying what it holds, or recording where it holds nothing usable."""
    try:
        replay = [(tag, nbytes) for tag, nbytes in json.loads((entry / "manifest.json").read_text())]
        with open(entry / "weights.bin", "rb") as f:  # private: the file never changes
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        with contextlib.suppress(OSError, AttributeError):  # pages read in from now on: 2 MB ones
            mapping.madvise(mmap.MADV_HUGEPAGE)
        mapped = np.frombuffer(mapping, dtype=np.uint8)
        if len(mapped) != sum(-(-nbytes // ALIGNMENT) * ALIGNMENT for _, nbytes in replay):
            raise ValueError(f"{entry}: the weights do not match the manifest")
        os.utime(entry)  # recently used
        return WeightCache(entry, replay, mapped)
    except (OSError, ValueError):
        return WeightCache(entry)


@contextlib.contextmanager
def kept(folder: Path, key: str) -> Iterator[None]:
    """Within: saguaro's kernels take their buffers from the cache entry `key` of `folder`."""
    if not enabled():
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    cache = open_entry(folder / key)
    token = _current.set(cache)
    try:
        yield
    finally:
        _current.reset(token)
    if not cache.replayed():
        with contextlib.suppress(OSError):
            cache.write()
            evict(folder, budget_bytes(), keep=folder / key)


def take(tag: str, nbytes: int) -> tuple[torch.Tensor, bool]:
    """A buffer for one of the kernels' outputs: from the load's cache if there is one, else
    fresh memory; and whether it already holds the output."""
    cache = _current.get()
    if cache is None:
        return fresh_buffer(nbytes), False
    return cache.take(tag, nbytes)


def evict(folder: Path, budget: int, keep: Path) -> None:
    """Removes the least recently used entries (never `keep`) until the folder fits `budget`."""
    entries = sorted((e for e in folder.iterdir() if e.is_dir() and (e / "manifest.json").exists()),
                     key=lambda e: e.stat().st_mtime)
    sizes = {e: sum(f.stat().st_size for f in e.iterdir()) for e in entries}
    total = sum(sizes.values())
    for entry in entries:
        if total <= budget:
            break
        if entry != keep:
            shutil.rmtree(entry, ignore_errors=True)
            total -= sizes[entry]
