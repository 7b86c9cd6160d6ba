"""A GGUF model's repacked weights kept on disk (saguaro.models.weight_cache): the first load
writes them, the next maps them back and computes the same logits bit for bit; a cache entry
that does not match the load is not used, and the folder keeps to its budget."""
from __future__ import annotations

import json
import mmap

import pytest
import torch
import transformers

from saguaro.models import loader, weight_cache
from saguaro.models.native import bindings
from test_gguf import saguaro_logits
from test_quantized import KQUANT_SIZE, TOKENS, q4_k_m_files

pytestmark = pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """A Q4_K_M file of random blocks: Q4_K and Q6_K tiles, a stacked qkv, a Q6_K head."""
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**KQUANT_SIZE))
    return q4_k_m_files(source, tmp_path_factory.mktemp("q4_k_m"))[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_cache, "MIN_BYTES", 0)
    return tmp_path / "weights"


def loads(file) -> tuple[torch.Tensor, weight_cache.WeightCache]:
    """The logits of a fresh load of `file`, and the weight cache that load used."""
    used = []
    original = weight_cache.open_entry

    def opened(entry):
        used.append(original(entry))
        return used[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weight_cache, "open_entry", opened)
        model = loader.load_model(file, torch.bfloat16)
    return saguaro_logits(model, TOKENS), used[0]


def entry_of(cache):
    entries = list(cache.iterdir())
    assert len(entries) == 1
    return entries[0]


def test_the_second_load_maps_the_first_loads_weights(q4_k_m_file, cache):
    first, recorded = loads(q4_k_m_file)
    assert not recorded.replayed()
    tags = [tag for tag, _ in json.loads((entry_of(cache) / "manifest.json").read_text())]
    assert any(t.startswith("stack") for t in tags) and any(t.startswith("repack 14") for t in tags)  # Q6_K
    second, replayed = loads(q4_k_m_file)
    assert replayed.replayed() and len(replayed.recorded) == len(tags)
    assert torch.equal(first, second)


def test_the_mapped_bytes_are_the_weights(q4_k_m_file, cache):
    """Control: the replayed load computes with the file's bytes (altered, its logits change)."""
    first, _ = loads(q4_k_m_file)
    weights = entry_of(cache) / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[64 + 1000:64 + 1100] = bytes(100)  # codes of the first buffer (after its 64-byte stack header)
    weights.write_bytes(bytes(data))
    altered, replayed = loads(q4_k_m_file)
    assert replayed.replayed() and not torch.equal(first, altered)


def test_an_entry_that_does_not_match_the_load_is_replaced(q4_k_m_file, cache):
    first, _ = loads(q4_k_m_file)
    manifest = entry_of(cache) / "manifest.json"
    tags = json.loads(manifest.read_text())
    tags[1][0] = "repack 99 (1, 1)"  # what another loader might have asked for
    manifest.write_text(json.dumps(tags))
    second, used = loads(q4_k_m_file)
    assert not used.replayed() and torch.equal(first, second)
    third, used = loads(q4_k_m_file)  # rewritten by the second load
    assert used.replayed() and torch.equal(first, third)


def test_other_options_get_their_own_entry_and_the_switch_turns_it_off(q4_k_m_file, cache, monkeypatch):
    loads(q4_k_m_file)
    loader.load_model(q4_k_m_file, torch.float32)
    assert len(list(cache.iterdir())) == 2
    monkeypatch.setenv("SAGUARO_WEIGHT_CACHE", "0")
    for entry in cache.iterdir():
        (entry / "manifest.json").unlink()
    loader.load_model(q4_k_m_file, torch.bfloat16)
    assert not any((entry / "manifest.json").exists() for entry in cache.iterdir())


def test_the_least_recently_used_entries_leave_first(q4_k_m_file, cache, monkeypatch):
    loads(q4_k_m_file)
    bf16 = entry_of(cache)
    size = sum(f.stat().st_size for f in bf16.iterdir())
    monkeypatch.setenv("SAGUARO_WEIGHT_CACHE_GB", str(1.5 * size / 2**30))
    loader.load_model(q4_k_m_file, torch.float32)  # a second entry: over the budget, the older one leaves
    (remaining,) = list(cache.iterdir())
    assert remaining != bf16 and "float32" in remaining.name


def test_a_truncated_entry_is_not_used(q4_k_m_file, cache):
    first, _ = loads(q4_k_m_file)
    weights = entry_of(cache) / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:-4096])  # a copy cut short
    second, used = loads(q4_k_m_file)
    assert not used.replayed() and torch.equal(first, second)


def huge_pages_of(address: int) -> int:
    """kB of the mapping holding `address` that lie on transparent huge pages (/proc/self/smaps)."""
    found = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            found = start <= address < end
        elif found and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def thp_mode() -> str:
    try:
        modes = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return modes.split("[")[1].split("]")[0]


@pytest.mark.skipif(thp_mode() != "madvise", reason="only where 2 MB pages are asked for per mapping does asking show")
@pytest.mark.parametrize("asked", [True, False])
def test_fresh_buffers_lie_on_2mb_pages(asked):
    """The kernels stream weights faster from 2 MB pages: a fresh buffer of its own mapping asks
    for them and outlives the mapping's Python object; the control, a mapping that does not ask,
    gets none. (torch.empty's memory, the control before, came from wherever the allocator had
    it, which now and then lay on 2 MB pages: about one run in five of a long test process.)"""
    nbytes = 10 * 2**20 + 12345  # over SHARED_BLOCK / 4: a mapping of its own
    buffer = weight_cache.fresh_buffer(nbytes) if asked else \
        torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    assert buffer.numel() == nbytes
    buffer.fill_(7)
    huge = huge_pages_of(buffer.data_ptr())
    assert (huge >= 4 * 1024) if asked else huge == 0
    assert int(buffer[-1]) == 7


@pytest.mark.skipif(thp_mode() != "madvise", reason="only where 2 MB pages are asked for per mapping does asking show")
def test_small_fresh_buffers_share_2mb_pages():
    """A small model's projections (under 2 MB each) lie on 2 MB pages too, side by side in a
    shared mapping: each its own bytes, aligned, none overlapping (from the heap, they got none)."""
    sizes = [663_552, 1_105_920, 3 * 2**20 + 5, 64, 1_769_472] * 4
    buffers = [weight_cache.fresh_buffer(n) for n in sizes]
    for i, buffer in enumerate(buffers):
        assert buffer.numel() == sizes[i] and buffer.data_ptr() % weight_cache.ALIGNMENT == 0
        buffer.fill_(i)
    assert [int(b[0]) == i == int(b[-1]) for i, b in enumerate(buffers)] == [True] * len(buffers)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert huge_pages_of(buffers[1].data_ptr()) >= 2 * 1024


@pytest.mark.parametrize("most", [None, 100_003])
def test_an_entry_is_written_whole_2mb_blocks_at_a_time(tmp_path, monkeypatch, most):
    """Pieces of any sizes reach the file byte for byte, one call per 2 MB block of the file (so
    that the page cache holds it in 2 MB folios), also where a call writes fewer bytes than asked."""
    import os
    generator = torch.Generator().manual_seed(0)
    sizes = [3, 2**21 - 3, 5 * 2**19 + 17, 0, 64, 2**21, 2**22 + 1000]
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator).numpy() for n in sizes]
    calls, writev = [], os.writev

    def limited(fd, parts):
        asked = sum(len(p) for p in parts)
        calls.append(asked)
        if most is None:
            return writev(fd, parts)
        kept, left = [], most
        for part in parts:
            kept.append(part[:left])
            left -= len(kept[-1])
        return writev(fd, kept)

    monkeypatch.setattr(os, "writev", limited)
    path = tmp_path / "entry.bin"
    with open(path, "wb") as f:
        weight_cache.write_in_blocks(f.fileno(), (memoryview(p) for p in pieces))
    assert path.read_bytes() == b"".join(p.tobytes() for p in pieces)
    if most is None:
        total = sum(sizes)
        assert calls == [2**21] * (total // 2**21) + [total % 2**21]


def test_fresh_buffers_taken_inside_inference_mode_can_be_filled_outside_it(monkeypatch):
    """A model loaded inside torch.inference_mode leaves the shared block's rest to the next load:
    a draft packed outside it must still fill its tiles in place there (an inference tensor's
    views cannot be, which failed gpu_check's greedy check whenever a concurrent first load of the
    same model made the draft's tiles land in that rest). Control: a block made as before, inside
    inference mode, refuses exactly that fill."""
    monkeypatch.setattr(weight_cache, "_shared", weight_cache.SharedBlock())
    with torch.inference_mode():
        first = weight_cache.fresh_buffer(4096)
        first.fill_(1)
    later = weight_cache.fresh_buffer(4096)  # carved from the same block
    later.copy_(torch.full((4096,), 2, dtype=torch.uint8))
    assert int(first.sum()) == 4096 and int(later.sum()) == 2 * 4096

    monkeypatch.setattr(weight_cache, "_shared", weight_cache.SharedBlock())
    with torch.inference_mode():
        weight_cache._shared.carve(4096)  # the block made in inference mode, as before the fix
    with pytest.raises(RuntimeError, match="inference tensor"):
        weight_cache._shared.carve(4096).copy_(torch.zeros(4096, dtype=torch.uint8))
