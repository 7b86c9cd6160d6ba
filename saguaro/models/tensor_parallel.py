"""Tensor parallelism for the target: its layers split across processes (ranks), as Megatron-LM
and vLLM split them.

Each rank holds a slice of every layer: whole KV heads (with the query heads that read them)
of the attention, and a slice of the MLP's intermediate columns. q, k, v and gate/up are
column-parallel (each rank computes its own heads and columns from the whole input); o and
down are row-parallel (each rank's partial product is summed across ranks by an all-reduce).
The embeddings, norms and head are replicated, so every rank ends a pass with the same hidden
states and rank 0 computes logits alone. Heads are split as evenly as whole KV heads allow, so
SmolLM2-135M's 3 KV heads go 1 + 2 over two ranks.

Rank 0 runs the engine. Before each pass it broadcasts the pass's inputs (tokens, positions,
cache rows and slots, mask, and which of its KV caches it writes), and the other ranks run the
same pass on their slices, each with a mirror of that cache holding its own heads. The ranks
are worker processes that saguaro starts, or the ranks of a `torchrun` launch, where ranks
other than 0 serve rank 0 from inside `LLM(...)` and exit when it closes.

The sum over two ranks is the same whichever order it is taken in, so with two ranks each
position's logits stay independent of what shares its pass (batch invariance), and greedy SD
and SSD equal AR. Against one rank the logits differ by fp32 rounding (the products are summed
in another order).

Prefix caching copies KV entries in and out of rank 0's cache only, so it is off here. The
layers run in torch (saguaro's one-call native layer has no place for an all-reduce).
"""
from __future__ import annotations

import atexit
import datetime
import os
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel

TIMEOUT = datetime.timedelta(seconds=300)


def split(total: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's share of `total` units, as even as whole units allow."""
    return [(total * r // world, total * (r + 1) // world) for r in range(world)]


def shard_config(config: ModelConfig, rank: int, world: int) -> ModelConfig:
    if world > config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world} exceeds the model's {config.num_kv_heads} KV heads: "
                         f"each rank needs one at least")
    kv0, kv1 = split(config.num_kv_heads, world)[rank]
    i0, i1 = split(config.intermediate_size, world)[rank]
    group = config.num_heads // config.num_kv_heads
    return replace(config, num_kv_heads=kv1 - kv0, num_heads=(kv1 - kv0) * group, intermediate_size=i1 - i0)


def shard_state(config: ModelConfig, state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of a whole model's state dict (fused qkv and gate/up, as LlamaModel names them)."""
    D, G, H, Hkv = config.head_dim, config.num_heads // config.num_kv_heads, config.num_heads, config.num_kv_heads
    kv0, kv1 = split(Hkv, world)[rank]
    i0, i1 = split(config.intermediate_size, world)[rank]
    I = config.intermediate_size
    qkv_rows = torch.cat([torch.arange(kv0 * G * D, kv1 * G * D), torch.arange((H + kv0) * D, (H + kv1) * D),
                          torch.arange((H + Hkv + kv0) * D, (H + Hkv + kv1) * D)])
    gate_up_rows = torch.cat([torch.arange(i0, i1), torch.arange(I + i0, I + i1)])
    shard = {}
    for name, value in state.items():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            value = value[qkv_rows]
        elif name.endswith("o_proj.weight"):
            value = value[:, kv0 * G * D:kv1 * G * D]
        elif name.endswith("gate_up_proj.weight"):
            value = value[gate_up_rows]
        elif name.endswith("down_proj.weight"):
            value = value[:, i0:i1]
        shard[name] = value.contiguous()
    return shard


def shard_model(model: LlamaModel, rank: int, world: int) -> LlamaModel:
    """Rank `rank`'s slice of a whole (full-precision) model, frozen for inference."""
    from saguaro.models.build import assemble

    if model.quantization not in (None, "none"):
        raise ValueError("tensor parallelism splits full-precision weights: load with quantization='none'")
    config = shard_config(model.config, rank, world)
    state = shard_state(model.config, model.state_dict(), rank, world)
    return assemble(config, state, quantization=model.quantization)


class Ranks:
    """The process group of a tensor-parallel target, from rank 0's side or another's."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums x over the ranks, in place."""
        self.group.allreduce([x]).wait()

    def broadcast(self, message=None):
        """Rank 0's message (pickled) on every rank."""
        size = torch.zeros(1, dtype=torch.int64)
        payload = None
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(message, protocol=5)), dtype=torch.uint8)
            size[0] = payload.numel()
        self._broadcast(size)
        if payload is None:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(payload)
        return message if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()


def join(shard: LlamaModel, ranks: Ranks, batch_invariant: bool, driver: Driver | None = None) -> LlamaModel:
    """The shard running with its ranks: its row-parallel projections (o, down) sum their ranks'
    partial products, and rank 0's `driver` announces each pass to the others."""
    shard.use(replace(shard.execution, batch_invariant=batch_invariant, reduce=ranks.all_reduce, tensor_parallel=driver))
    return shard


class Driver:
    """Rank 0's side: announces each pass to the other ranks (see LlamaModel.forward)."""

    def __init__(self, ranks: Ranks, processes: list[subprocess.Popen], store: dist.Store | None = None):
        self.ranks, self.processes = ranks, processes
        self.store = store  # the rendezvous lives as long as the group
        self.closed = False
        atexit.register(self.close)

    def announce(self, tokens, positions, cache: KVCache, rows, slots, mask) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel target was closed")
        lost = [p.returncode for p in self.processes if p.poll() is not None]
        if lost:
            self.closed = True
            raise RuntimeError(f"a tensor-parallel rank exited (exit code {lost[0]})")
        self.ranks.broadcast((id(cache), (cache.num_rows, cache.num_slots), tokens, positions, rows, slots, mask))

    def close(self) -> None:
        """Stops the other ranks (also done at exit)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.ranks.broadcast(None)
        except RuntimeError:
            pass  # a rank already gone
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def serve(model: LlamaModel, ranks: Ranks) -> None:
    """A rank other than 0: runs rank 0's passes on this rank's slice until it closes."""
    caches: dict[int, KVCache] = {}
    while (message := ranks.broadcast()) is not None:
        key, (num_rows, num_slots), tokens, positions, rows, slots, mask = message
        cache = caches.get(key)
        if cache is None or (cache.num_rows, cache.num_slots) != (num_rows, num_slots):
            caches[key] = cache = mirror(cache, model, num_rows, num_slots)
        with torch.inference_mode():
            model(tokens, positions, cache, rows=rows, slots=slots, mask=mask)


def mirror(old: KVCache | None, model: LlamaModel, num_rows: int, num_slots: int) -> KVCache:
    """A cache of rank 0's shape for this rank's heads, keeping what the old one held where they overlap."""
    cache = KVCache(model.config, num_rows, num_slots, model.dtype, model.device)
    if old is not None:
        rows, slots = min(num_rows, old.num_rows), min(num_slots, old.num_slots)
        cache.keys[:, :rows, :, :slots] = old.keys[:, :rows, :, :slots]
        cache.values[:, :rows, :, :slots] = old.values[:, :rows, :, :slots]
    return cache


def _gloo(store: dist.Store, rank: int, world: int) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, options)


def load_shard(path: str, dtype: torch.dtype, rank: int, world: int) -> LlamaModel:
    """This rank's slice of the checkpoint at `path`, read whole in full precision."""
    from saguaro.models.loader import load_model

    whole = load_model(path, dtype, "cpu", "none")
    return shard_model(whole, rank, world)


def _await_loaded(store: dist.TCPStore, processes: list[subprocess.Popen]) -> None:
    """Waits for every worker to load its slice; one that exits first is an error at once, not
    after the group's timeout."""
    keys = [f"loaded{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, process in enumerate(processes, 1):
            if process.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while loading (exit code {process.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError("tensor-parallel ranks did not load within the timeout")
        time.sleep(0.05)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def tensor_parallel(path: str | Path, dtype: torch.dtype, world: int, device: str = "cpu",
                    batch_invariant: bool = True) -> LlamaModel:
    """Rank 0's slice of the checkpoint at `path`, the other world - 1 ranks serving it: worker
    processes started here (`python -c WORKER`, each loading the
    checkpoint itself), or under torchrun the launch's other ranks, which serve from here and
    exit when rank 0 closes. Each rank gets an equal share of this process's torch threads."""
    if torch.device(device).type != "cpu":
        raise ValueError("tensor parallelism runs on CPU (gloo) in this version; CUDA (NCCL) is not built yet")
    path, threads = str(path), max(1, torch.get_num_threads() // world)
    torch.set_num_threads(threads)
    if not under_torchrun():
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=TIMEOUT, wait_for_workers=False)
        dtype_name = str(dtype).removeprefix("torch.")
        processes = [subprocess.Popen([sys.executable, "-c", WORKER, path, dtype_name, str(rank), str(world),
                                       str(store.port), str(threads), str(int(batch_invariant))])
                     for rank in range(1, world)]
        try:
            shard = load_shard(path, dtype, 0, world)
            _await_loaded(store, processes)
            ranks = Ranks(_gloo(store, 0, world), 0, world)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        return join(shard, ranks, batch_invariant, Driver(ranks, processes, store))
    if int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks for tensor_parallel_size {world}")
    rank = int(os.environ["RANK"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=TIMEOUT)
    ranks = Ranks(dist.distributed_c10d._get_default_group(), rank, world)
    shard = join(load_shard(path, dtype, rank, world), ranks, batch_invariant, Driver(ranks, []) if rank == 0 else None)
    if rank == 0:
        return shard
    serve(shard, ranks)
    dist.destroy_process_group()
    raise SystemExit(0)


WORKER = "import sys; from saguaro.models.tensor_parallel import worker; worker(*sys.argv[1:])"


def worker(path: str, dtype: str, rank: str, world: str, port: str, threads: str, batch_invariant: str) -> None:
    """A rank that saguaro started: loads its slice, says so, joins the group, serves rank 0."""
    rank, world = int(rank), int(world)
    torch.set_num_threads(int(threads))
    store = dist.TCPStore("127.0.0.1", int(port), world, False, timeout=TIMEOUT)
    shard = load_shard(path, getattr(torch, dtype), rank, world)
    store.set(f"loaded{rank}", "1")
    ranks = Ranks(_gloo(store, rank, world), rank, world)
    try:
        serve(join(shard, ranks, batch_invariant == "1"), ranks)
    except RuntimeError:
        pass  # rank 0 went away without closing: its connection is gone, and so is this rank's work

