"""The engine's and speculation's configurations, each declared once: `EngineConfig` (the model,
how it runs, how many sequences it admits at once) and `SpeculativeConfig` (how to speculate,
in the style of vLLM's `speculative_config`). `LLM`, the CLI, `saguaro serve`, the bench and the
draft worker's handshake read them; their command-line options are generated from the fields."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from saguaro.models import hub
from saguaro.models.graphs import SETTINGS as GRAPH_SETTINGS
from saguaro.models.quantized import MODES, resolve_dtype

if TYPE_CHECKING:
    import torch

METHODS = ("ar", "sd", "ssd", "auto")


class Backup(StrEnum):
    """SSD's speculation on a cache miss."""
    NEURAL = "neural"  # the draft drafts it now
    FAST = "fast"  # the n-gram guess, at no model cost
    AUTO = "auto"  # neural below the critical batch size, fast above (chosen round by round)


BACKUPS = tuple(b.value for b in Backup)
FAN_OUTS = ("geometric", "uniform")  # the planned fan-outs SpeculativeConfig.fan_out may name


def checked_fan_out(fan_out: list[int], k: int) -> list[int]:
    """A fan-out as a list: K+1 counts >= 0 of cached bonus tokens, one per accepted length. The
    one check, wherever a fan-out is set (the config, a re-plan, the worker's copy)."""
    fan_out = list(fan_out)
    if len(fan_out) != k + 1 or min(fan_out) < 0:
        raise ValueError(f"fan_out needs K+1 = {k + 1} counts >= 0, got {fan_out}")
    return fan_out


def _option(default, help: str, *flags: str, group: str = "speculation", described: str | None = None,
            shown: bool = True, **argparse_kwargs):
    """A field with its command-line option: flags (default: --the-field-name), its group, and
    how the help describes its default (default: the value). shown=False: left out of repr."""
    return field(default=default, repr=shown, metadata={"help": help, "flags": flags, "group": group,
                                                         "described": described,
                                                         **argparse_kwargs})


@dataclass
class EngineConfig:
    """The target model, how it runs, and how many sequences the engine admits at once (the
    rest wait, in arrival order, until running ones finish). See `LLM` for what each means."""
    model: str = _option(hub.DEFAULT_MODEL, "a known name or a checkpoint path", group="model")
    dtype: str | torch.dtype = _option("auto", "auto (bf16), bf16, fp16 or fp32", group="model")
    device: str = _option("cpu", "torch device", group="model")
    num_threads: int | None = _option(None, "torch CPU threads", "--threads", group="model", described="torch's",
                                      metavar="N")
    batch_invariant: bool = _option(True, "each position's logits independent of what shares its pass, so greedy "
                                          "SD/SSD equal AR in every dtype", group="model")
    quantization: str | None = _option("auto", "auto: a GGUF's 4-bit blocks run as int4 (CPU, bf16), the rest in "
                                               "--dtype; none: all in --dtype; int8 / int4: every projection "
                                               "quantized", group="model", choices=MODES)
    tensor_parallel_size: int = _option(1, "split the target's layers over this many processes (CPU, full "
                                           "precision; under torchrun: its ranks)", "--tensor-parallel-size", "-tp",
                                        group="model")
    enable_prefix_caching: bool = _option(True, "reuse the KV entries of prompts that start like earlier ones",
                                          group="model")
    prefix_cache_mb: float = _option(512.0, "MiB of prompt KV entries kept for reuse, the target's and the draft's "
                                            "each", group="model")
    max_num_seqs: int = _option(256, "sequences decoded at once; the rest wait for a place", group="admission")
    kv_cache_mb: float = _option(4096.0, "MiB of the target's KV cache for the sequences decoded at once, each "
                                         "holding a row as long as the longest needs; the others wait",
                                 group="admission")
    cuda_graphs: str = _option("auto", "capture small passes (decode steps, verification, draft steps) as CUDA "
                                       "graphs: auto on a CUDA device; off; emulated (the same buffers replayed "
                                       "eagerly, on any device: for tests)", group="model", choices=GRAPH_SETTINGS)

    def __post_init__(self):
        resolve_dtype(self.dtype)  # raises on an unknown name
        if self.quantization not in (*MODES, None):
            raise ValueError(f"quantization must be one of {', '.join(MODES)}, not {self.quantization!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.quantization not in ("auto", "none", None):
            raise ValueError(f"tensor parallelism splits full-precision weights; quantization {self.quantization!r} "
                             "is not supported with it")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_mb <= 0:
            raise ValueError(f"kv_cache_mb must be > 0, got {self.kv_cache_mb}")
        if self.cuda_graphs not in GRAPH_SETTINGS:
            raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_SETTINGS)}, not {self.cuda_graphs!r}")

    @property
    def prefix_cache_budget_mb(self) -> float:
        """The prefix cache's MiB: none when it is off, or under tensor parallelism, where it would
        restore rank 0's KV entries only."""
        return self.prefix_cache_mb if self.enable_prefix_caching and self.tensor_parallel_size == 1 else 0.0


@dataclass(frozen=True)
class TreeShape:
    """How a draft grows its tree, in SGLang's terms: `depth` draft steps
    (speculative_num_steps); at each, the `topk` most likely nodes so far are expanded into
    their `topk` most likely children (speculative_eagle_topk); the `num_nodes` most likely of
    all are verified (speculative_num_draft_tokens)."""
    depth: int
    topk: int
    num_nodes: int

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.num_nodes < 1:
            raise ValueError(f"a tree needs depth, topk and num_nodes >= 1, got {self}")
        if self.num_nodes > self.grown:
            raise ValueError(f"a tree of depth {self.depth} and topk {self.topk} grows {self.grown} nodes; "
                             f"{self.num_nodes} cannot be verified")

    def __str__(self) -> str:
        return f"tree {self.depth}x{self.topk}x{self.num_nodes}"  # depth x top-k x nodes

    @property
    def grown(self) -> int:
        """Nodes the draft scores: topk children of the root, topk^2 at each further depth."""
        return self.topk + (self.depth - 1) * self.topk ** 2

    @property
    def span(self) -> int:
        """KV slots a round writes past the committed text: the target's nodes, the draft's
        expanded ones."""
        return max(self.num_nodes, self.topk * (self.depth - 1))


@dataclass
class SpeculativeConfig:
    """What the draft is and how it speculates. With method "ar" the rest is ignored. The default,
    "auto", speculates where it pays, with the target's shipped draft where it has one."""
    method: str = _option("auto", "ar (autoregressive), sd (draft in this process), ssd (draft in its own "
                                  "process, overlapping verification) or auto (each round AR, SD with the K "
                                  "that pays, or SSD where its draft has a core of its own, measured as it "
                                  "runs; AR where the target has no draft)", choices=METHODS)
    draft: str | None = _option(None, "draft model: a known name or a checkpoint path (default: the target's "
                                      "shipped draft)")
    num_speculative_tokens: int = _option(5, "draft tokens per round (K; auto: the most); a token tree's depth",
                                         "-k", "--num-speculative-tokens", "--speculative-num-steps")
    prompt_lookup: int | None = _option(2, "where the last N tokens occurred earlier in the text, speculate "
                                           "what followed them instead of drafting; 0 turns it off", metavar="N")
    fan_out: str | list[int] = _option("geometric", "geometric, uniform, or K+1 comma-separated counts of cached "
                                                    "bonus tokens per accepted length", group="ssd")
    fan_out_budget: int = _option(16, "cached branches per request", group="ssd")
    saguaro_c: float = _option(1.0, "Saguaro sampling constant C (1 = off)", group="ssd")
    backup: Backup = _option(Backup.AUTO, "speculation on a cache miss: neural (draft now), fast (n-gram), or auto "
                                  "(by batch size)", group="ssd", choices=BACKUPS)
    draft_device: str = _option("cpu", "the draft worker's device", group="ssd")
    draft_address: str | None = _option(None, "HOST:PORT to await a worker started elsewhere "
                                               "(python -m saguaro.speculation.worker --connect HOST:PORT); "
                                               "several, comma-separated, for several workers", group="ssd")
    acceptance_rate: float = _option(0.75, "prior per-token acceptance for the geometric fan-out (re-fitted "
                                           "to the measured one every 16 rounds)", group="ssd")
    power_law_r: float = _option(0.6, "exponent r of the cache miss rate F^-r", group="ssd")
    proposal_top: int = _option(256, "at temperature > 0 the worker drafts from its N most likely tokens "
                                    "(renormalized), so N (token, probability) pairs per draft token cross the "
                                    "wire instead of the whole head; 0 keeps every token", group="ssd", metavar="N")
    num_draft_workers: int = _option(1, "SSD draft workers on this machine, each drafting for its share of the "
                                        "requests (with --draft-address: one per comma-separated address)",
                                     group="ssd")
    share_window: int = _option(0, "a request whose speculation missed may take a branch another request "
                                   "drafted but did not use, after text ending in the same N tokens (exact: a "
                                   "proposal is verified as drafted); 0: off", group="ssd", metavar="N")
    draft_secret: str | None = _option(None, "the secret a worker attached by --draft-address must know "
                                              "(required there; prefer the environment variable, which other "
                                              "users cannot read with ps); a local worker gets a random one",
                                       group="ssd", described="$SAGUARO_DRAFT_SECRET", shown=False)
    tree_topk: int | None = _option(None, "grow token trees: expand the N most likely nodes at each of the K "
                                          "depths into their N most likely children (SGLang's "
                                          "speculative_eagle_topk); 1: chains only; default: SD chains, auto "
                                          "weighs two trees of its own beside them on an accelerator (with N "
                                          "> 1: this one, anywhere)",
                                    "--tree-topk", "--speculative-eagle-topk", metavar="N", described="none")
    num_draft_tokens: int | None = _option(None, "the nodes of a token tree the target verifies (SGLang's "
                                                 "speculative_num_draft_tokens)", "--num-draft-tokens",
                                           "--speculative-num-draft-tokens", described="2K", metavar="N")
    ssd_draft: str | None = _option(None, "SSD's draft model, whose steps its worker hides behind verification, "
                                          "so it may be deeper than SD's: a known name or a checkpoint path "
                                          "(default: the target's shipped SSD draft where it has one, else "
                                          "--draft)", group="ssd")

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.tree_topk is not None and self.tree_topk < 1:
            raise ValueError("tree_topk must be >= 1")
        if self.tree is None and self.num_draft_tokens not in (None, self.num_speculative_tokens):
            raise ValueError("num_draft_tokens sizes a token tree: set tree_topk > 1 (a chain verifies "
                             "num_speculative_tokens)")
        if self.tree is not None and self.method == "ssd":
            raise ValueError("SSD's workers speculate chains; token trees run with method 'sd' or 'auto'")
        if self.backup not in BACKUPS:
            raise ValueError(f"backup must be one of {', '.join(BACKUPS)}")
        self.backup = Backup(self.backup)
        if self.proposal_top < 0:
            raise ValueError("proposal_top must be >= 0")
        if self.share_window < 0:
            raise ValueError("share_window must be >= 0")
        if self.num_draft_workers < 1:
            raise ValueError("num_draft_workers must be >= 1")
        if self.fan_out_budget < 0:
            raise ValueError("fan_out_budget must be >= 0")
        if isinstance(self.fan_out, str) and self.fan_out not in FAN_OUTS:
            try:  # "2,2,1,1,0,0" from a command line
                self.fan_out = [int(f) for f in self.fan_out.split(",")]
            except ValueError:
                raise ValueError(f"fan_out is geometric, uniform or K+1 comma-separated counts, "
                                 f"not {self.fan_out!r}") from None
        if not isinstance(self.fan_out, str):
            self.fan_out = checked_fan_out(self.fan_out, self.num_speculative_tokens)

    def as_method(self, method: str, **overrides) -> SpeculativeConfig:
        """This config for another method (the bench runs each method on one config); SSD,
        which speculates chains, drops a tree."""
        if method == "ssd":
            overrides = {"tree_topk": None, "num_draft_tokens": None, **overrides}
        return replace(self, method=method, **overrides)

    @property
    def drafts_in_process(self) -> bool:
        """Whether a draft model runs in this process (SD's, and auto's SD rounds)."""
        return self.method in ("sd", "auto")

    @property
    def tree(self) -> TreeShape | None:
        """The token tree SD grows each round; None: chains of K."""
        if self.tree_topk is None or self.tree_topk == 1:
            return None
        k = self.num_speculative_tokens
        return TreeShape(k, self.tree_topk, self.num_draft_tokens or 2 * k)

    @classmethod
    def of(cls, config: SpeculativeConfig | dict | None = None, **overrides) -> SpeculativeConfig:
        """A config from a SpeculativeConfig, a dict of its fields or None (the defaults), with
        overrides; unknown names raise TypeError, listing the known ones."""
        if not (config is None or isinstance(config, (cls, dict))):
            raise TypeError(f"speculative_config is a SpeculativeConfig or a dict, not {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        given = config if isinstance(config, dict) else {}
        unknown = (set(given) | set(overrides)) - known
        if unknown:
            raise TypeError(f"unknown speculative option(s) {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(sorted(known))}")
        base = config if isinstance(config, cls) else cls(**given)
        return replace(base, **overrides) if overrides else base


def split_options(options: dict) -> tuple[dict, dict]:
    """Keyword options of `LLM` as (EngineConfig's, SpeculativeConfig's); unknown names raise
    TypeError, listing the known ones."""
    engine, speculative = ({f.name for f in fields(c)} for c in (EngineConfig, SpeculativeConfig))
    unknown = set(options) - engine - speculative
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(engine))} "
                        f"and the speculative ones, {', '.join(sorted(speculative))}")
    return ({k: v for k, v in options.items() if k in engine}, {k: v for k, v in options.items() if k in speculative})


def _add_arguments(parser: argparse.ArgumentParser, config: type, titles: dict[str, str], exclude: tuple[str, ...],
                   defaults: dict[str, tuple[object, str]] | None) -> None:
    """A config dataclass's fields as command-line options, in groups titled by `titles`.
    defaults: field -> (another default, how the help should describe it)."""
    defaults = defaults or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(config):
        if f.name in exclude:
            continue
        meta = dict(f.metadata)
        name, flags, described = meta.pop("group"), meta.pop("flags"), meta.pop("described")
        group = groups.get(name) or groups.setdefault(name, parser.add_argument_group(titles[name]))
        boolean = str(f.type) == "bool"
        default, described = defaults.get(f.name, (f.default, described))
        if described is None and default is not None:
            described = ("on" if default else "off") if boolean else "%(default)s"
        kind = {"int": int, "float": float, "int | None": int}.get(str(f.type))
        options = {"action": argparse.BooleanOptionalAction} if boolean else {"type": kind} if kind else {}
        help_text = meta.pop("help") + (f" (default: {described})" if described is not None else "")
        group.add_argument(*(flags or ["--" + f.name.replace("_", "-")]), dest=f.name, default=default,
                           help=help_text, **options, **meta)


def add_engine_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                         defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """The EngineConfig fields as command-line options (--model, --threads, --max-num-seqs, ...)."""
    _add_arguments(parser, EngineConfig, {"model": "model", "admission": "admission (sequences decoded at once)"},
                   exclude, defaults)


def add_speculative_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                              defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """The SpeculativeConfig fields as command-line options (--num-speculative-tokens, ...)."""
    _add_arguments(parser, SpeculativeConfig, {"speculation": "speculation (sd, ssd)", "ssd": "SSD (--method ssd)"},
                   exclude, defaults)


def _given(config: type, args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(config) if hasattr(args, f.name)}


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig the options of `add_engine_arguments` describe."""
    return EngineConfig(**{**_given(EngineConfig, args), **overrides})


def speculative_config_from_args(args: argparse.Namespace, **overrides) -> SpeculativeConfig:
    """The SpeculativeConfig the options of `add_speculative_arguments` describe."""
    return SpeculativeConfig(**{**_given(SpeculativeConfig, args), **overrides})
