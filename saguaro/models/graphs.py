"""Small passes captured once and replayed: CUDA graphs for decode steps, verification and draft steps.

On a GPU a small model's decode step is a few hundred short kernels, each launched from Python:
the launches bound it, not the arithmetic. A CUDA graph records one pass's kernels once and
replays them all with one launch. A graph has fixed shapes and addresses, so each (rows, tokens
per row, attended slots, whether the rows are the cache's first) gets its own, captured the first
time it is needed, over static input buffers that every pass copies its inputs into. Rows other
than the cache's first B are read by index, which copies their entries, as an eager pass does. Attended slots are rounded up to a power of two:
the extra slots are masked, cost little, and spare captures. The graphs write the KV cache in
place, so they belong to one cache's tensors: when the cache grows (new tensors), they go.

Passes no graph takes run eagerly, as on the CPU: longer ones (prompts, more than MAX_TOKENS
tokens a row: not launch-bound, and of too many shapes to capture) and a draft that reads the
target's features.

Mode "emulated" keeps the buffers, buckets and masks but replays by calling the model: what CI
runs on the CPU, so that everything but the capture itself stays tested there.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel

MAX_TOKENS = 16  # tokens a row in a captured pass: a verification of K + 1, a tree's nodes, a worker's branches
MIN_SLOTS = 64  # the smallest bucket of attended slots
SETTINGS = ("auto", "off", "emulated")  # EngineConfig.cuda_graphs


@dataclass
class StaticPass:
    """One captured shape: the buffers its inputs are copied into, its output, its graph."""
    rows: torch.Tensor | None  # [B] cache rows; None: the first B
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    slots: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T, S]
    hidden: torch.Tensor | None = None  # [B, T, hidden], what a replay leaves
    graph: torch.cuda.CUDAGraph | None = None  # None: emulated


class StepGraphs:
    """A model's captured passes over one KV cache, by (rows, tokens a row, attended slots,
    rows by index)."""

    def __init__(self, model: LlamaModel, mode: str = "cuda"):
        if mode == "cuda" and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, not {model.device}")
        self.model, self.mode = model, mode
        self.passes: dict[tuple[int, int, int, bool], StaticPass] = {}
        self.cache_address: int | None = None  # the keys tensor the graphs write into
        self.pool = None  # the memory pool the captures share, made anew with each cache (see run)
        self.captures = self.replays = 0

    def slots_for(self, span: int, cache: KVCache) -> int:
        """The bucket of attended slots for a pass that needs the first `span`."""
        return min(max(MIN_SLOTS, 1 << (span - 1).bit_length()), cache.num_slots)

    def takes(self, tokens_per_row: int) -> bool:
        """Whether a pass of this many tokens a row runs captured."""
        return tokens_per_row <= MAX_TOKENS

    def run(self, cache: KVCache, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model's hidden states [B, T, hidden] over cache rows `rows`; the inputs as
        LlamaModel.forward takes them (on any device), mask [B, T, span]."""
        if cache.keys.data_ptr() != self.cache_address:
            self._forget(cache)
        (B, T), span = tokens.shape, mask.shape[-1]
        by_index = rows != list(range(B))
        key = (B, T, self.slots_for(span, cache), by_index)
        static = self.passes.get(key)
        if static is None:
            static = self.passes[key] = self._buffers(*key)
        if by_index:
            static.rows.copy_(torch.tensor(rows), non_blocking=True)
        static.tokens.copy_(tokens, non_blocking=True)
        static.positions.copy_(positions, non_blocking=True)
        static.slots.copy_(slots, non_blocking=True)
        static.mask[..., span:] = False
        static.mask[..., :span].copy_(mask, non_blocking=True)
        if static.hidden is None:
            self._capture(static, cache)
        if static.graph is not None:
            static.graph.replay()
        else:
            static.hidden = self._forward(static, cache)
        self.replays += 1
        return static.hidden.clone()  # the next replay of any graph may overwrite it

    def _forget(self, cache: KVCache) -> None:
        """Drops the graphs of a cache that is gone (they would write into freed memory). Their
        pool goes with them: once its last graph is freed, PyTorch's allocator frees the pool, and
        a capture into its old handle fails an internal assert (what the first run on a GPU met
        in the SSD worker, whose cache grows as requests arrive)."""
        self.passes.clear()
        self.cache_address = cache.keys.data_ptr()
        self.pool = torch.cuda.graph_pool_handle() if self.mode == "cuda" else None

    def _buffers(self, rows: int, tokens: int, slots: int, by_index: bool) -> StaticPass:
        device = self.model.device
        index = lambda: torch.zeros(rows, tokens, dtype=torch.long, device=device)  # noqa: E731
        return StaticPass(torch.arange(rows, device=device) if by_index else None, index(), index(), index(),
                          torch.zeros(rows, tokens, slots, dtype=torch.bool, device=device))

    def _forward(self, static: StaticPass, cache: KVCache) -> torch.Tensor:
        return self.model(static.tokens, static.positions, cache, rows=static.rows, slots=static.slots,
                          mask=static.mask, static_shapes=True)

    def _capture(self, static: StaticPass, cache: KVCache) -> None:
        """Records the pass. Its KV writes are the real ones: the inputs are already in place."""
        self.captures += 1
        if self.mode != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(static, cache)  # lazy set-up (cuBLAS workspaces) may not happen while capturing
        torch.cuda.current_stream().wait_stream(side)
        static.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(static.graph, pool=self.pool):
            static.hidden = self._forward(static, cache)


def attach(model: LlamaModel, setting: str) -> LlamaModel:
    """Gives the model captured passes as `setting` (SETTINGS) says: "auto" on a CUDA device
    only, "emulated" anywhere, "off" never."""
    if setting not in SETTINGS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(SETTINGS)}, not {setting!r}")
    captured = None
    if setting == "emulated":
        captured = StepGraphs(model, "emulated")
    elif setting == "auto" and model.device.type == "cuda" and model.tensor_parallel is None:
        captured = StepGraphs(model, "cuda")
    model.use(replace(model.execution, cuda_graphs=setting, step_graphs=captured))
    return model
