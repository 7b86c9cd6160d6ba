"""Training text and teacher distributions, computed once and reused every epoch.

The draft is judged on the target's own greedy continuations of chat and code prompts, so that
is the training text: the target generates it, and the top-k logits it computes while doing so
(at every prompt and generated position) are the distillation targets. The target's forward
pass is by far the most expensive part of distillation; caching its top-k makes epochs cheap.
"""
from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel


@dataclass
class TeacherConfig:
    top_k: int = 32
    new_tokens: int = 128
    batch_size: int = 32
    max_prompt_tokens: int = 320
    seed: int = 0


@dataclass
class Sequence:
    """One training sequence. topk_ids/topk_logits[i] is the teacher's prediction for tokens[i+1]."""
    tokens: torch.Tensor  # [L] int32
    num_prompt: int
    topk_ids: torch.Tensor  # [L-1, k] int32
    topk_logits: torch.Tensor  # [L-1, k] float16
    features: torch.Tensor | None = None  # [L, hidden] the target's final hidden states (EAGLE drafts)


# --- prompts ---------------------------------------------------------------------------------

def chat_ids(tokenizer, text: str) -> list[int]:
    """A user message in the target's chat template, ready for the assistant's answer."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(chat, add_special_tokens=False)


def stdlib_functions(limit: int | None = None) -> list[tuple[str, str]]:
    """(signature, docstring) of documented module-level functions of the Python standard library.

    Code training prompts come from here because HumanEval is reserved for evaluation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for file in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in file.parts[-2:] or file.name.startswith("test"):
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and 40 <= len(doc) <= 800:
                found.append((f"def {node.name}({ast.unparse(node.args)}):", doc))
    return found[:limit] if limit else found


def code_prompts(tokenizer, functions: list[tuple[str, str]]) -> list[list[int]]:
    """Each function twice: as a raw completion prompt (signature + docstring, HumanEval's
    shape) and as a chat request."""
    prompts = []
    for signature, doc in functions:
        body = "\n".join(f"    {line}" if line else "" for line in doc.splitlines())
        prompts.append(tokenizer.encode(f'{signature}\n    """{body.lstrip()}\n    """\n'))
        prompts.append(chat_ids(tokenizer, f"Write a Python function `{signature[4:-1]}`.\n\n{doc}"))
    return prompts


def training_prompts(tokenizer, chat_texts: list[str], functions: list[tuple[str, str]],
                     config: TeacherConfig) -> list[list[int]]:
    """Chat and code prompts, shuffled with the seed, too-long ones dropped."""
    prompts = [chat_ids(tokenizer, t) for t in chat_texts] + code_prompts(tokenizer, functions)
    prompts = [p for p in prompts if len(p) <= config.max_prompt_tokens]
    random.Random(config.seed).shuffle(prompts)
    return prompts


def length_batches(prompts: list[list[int]], batch_size: int, group: int = 8) -> list[list[list[int]]]:
    """Batches of similar length (sorted within groups of `group` batches) to waste little
    compute on padding, in an order that still mixes the prompt kinds."""
    batches = []
    for start in range(0, len(prompts), batch_size * group):
        chunk = sorted(prompts[start:start + batch_size * group], key=len)
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


# --- the teacher ------------------------------------------------------------------------------

def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logits.topk(k, dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


@torch.inference_mode()
def teach_batch(target: LlamaModel, prompts: list[list[int]], config: TeacherConfig,
                eos_ids: set[int]) -> list[Sequence]:
    """Greedy continuations of `prompts` by the target, with its top-k logits at every position."""
    B, k = len(prompts), config.top_k
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    cache = KVCache(target.config, B, width + config.new_tokens, target.dtype, target.device)
    tokens = torch.zeros(B, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    hidden = target(tokens, torch.arange(width).expand(B, width), cache)
    seq_tokens = [list(p) for p in prompts]
    seq_ids, seq_logits, nxt = [], [], []
    for b in range(B):
        ids, vals = _topk(target.logits(hidden[b, :lengths[b]]), k)
        seq_ids.append([ids])
        seq_logits.append([vals])
        nxt.append(int(ids[-1, 0]))
    active = list(range(B))
    for _ in range(config.new_tokens):
        for b in active:
            seq_tokens[b].append(nxt[b])
        active = [b for b in active if nxt[b] not in eos_ids]
        if not active or len(seq_tokens[active[0]]) - len(prompts[active[0]]) >= config.new_tokens:
            break
        rows = torch.tensor(active)
        step = torch.tensor([[nxt[b]] for b in active])
        positions = (lengths[rows] + torch.tensor([len(seq_tokens[b]) - len(prompts[b]) - 1 for b in active]))[:, None]
        ids, vals = _topk(target.logits(target(step, positions, cache, rows=rows))[:, 0], k)
        for i, b in enumerate(active):
            seq_ids[b].append(ids[i:i + 1])
            seq_logits[b].append(vals[i:i + 1])
            nxt[b] = int(ids[i, 0])
    return [Sequence(torch.tensor(seq_tokens[b], dtype=torch.int32), len(prompts[b]),
                     torch.cat(seq_ids[b])[:len(seq_tokens[b]) - 1],
                     torch.cat(seq_logits[b])[:len(seq_tokens[b]) - 1]) for b in range(B)]


# --- shards on disk ----------------------------------------------------------------------------

def save_shard(sequences: list[Sequence], path: Path) -> None:
    """Written to a temporary name first, so a killed run never leaves a half shard behind."""
    partial = path.with_suffix(".partial")
    torch.save([vars(s) for s in sequences], partial)
    partial.replace(path)


def load_shard(path: Path) -> list[Sequence]:
    return [Sequence(**record) for record in torch.load(path)]


@torch.inference_mode()
def target_features(target: LlamaModel, sequences: list[Sequence]) -> list[torch.Tensor]:
    """The target's final hidden state at every position of each sequence, [L, hidden] bf16:
    what an EAGLE draft reads (and learns to predict)."""
    features = []
    for s in sequences:
        n = len(s.tokens)
        cache = KVCache(target.config, 1, n, target.dtype, target.device)
        hidden = target(s.tokens.long()[None].to(target.device), torch.arange(n, device=target.device)[None], cache)
        features.append(hidden[0].to(device="cpu", dtype=torch.bfloat16))
    return features


def with_features(target: LlamaModel, shards: list[Path], progress=None) -> list[Sequence]:
    """The shards' sequences with the target's hidden states attached. Features are cached
    next to each shard (features_NNNNN.pt), so an interrupted run resumes."""
    sequences = []
    for shard in shards:
        batch = load_shard(shard)
        path = shard.with_name(shard.name.replace("shard_", "features_"))
        if not path.exists():
            partial = path.with_suffix(".partial")
            torch.save(target_features(target, batch), partial)
            partial.replace(path)
        sequences += [replace(s, features=f) for s, f in zip(batch, torch.load(path))]
        if progress is not None:
            progress.update(1)
    return sequences


def generate_shards(target: LlamaModel, batches: list[list[list[int]]], folder: Path,
                    config: TeacherConfig, eos_ids: set[int], progress=None) -> Iterator[Path]:
    """One shard per batch; shards already on disk are skipped, so an interrupted run resumes."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, batch in enumerate(batches):
        path = folder / f"shard_{i:05d}.pt"
        if not path.exists():
            save_shard(teach_batch(target, batch, config, eos_ids), path)
        if progress is not None:
            progress.update(1)
        yield path
