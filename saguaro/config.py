"""How to speculate: one configuration for `LLM`, the CLI, `saguaro serve`, the bench and the
draft worker's handshake, in the style of vLLM's `speculative_config`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum

METHODS = ("ar", "sd", "ssd", "auto")


class Backup(StrEnum):
    """SSD's speculation on a cache miss."""
    NEURAL = "neural"  # the draft drafts it now
    FAST = "fast"  # the n-gram guess, at no model cost
    AUTO = "auto"  # neural below the critical batch size, fast above (chosen round by round)


BACKUPS = tuple(b.value for b in Backup)
FAN_OUTS = ("geometric", "uniform")


def _option(default, help: str, flag: str | None = None, group: str = "speculation", **argparse_kwargs):
    return field(default=default, metadata={"help": help, "flag": flag, "group": group, **argparse_kwargs})


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
    num_speculative_tokens: int = _option(5, "draft tokens per round (K; auto: the most)", flag="-k")
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

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
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
            self.fan_out = list(self.fan_out)
            if len(self.fan_out) != self.num_speculative_tokens + 1 or min(self.fan_out) < 0:
                raise ValueError(f"fan_out needs K+1 = {self.num_speculative_tokens + 1} counts >= 0")

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


def add_speculative_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                              defaults: dict[str, tuple[object, str]] | None = None) -> None:
    """The SpeculativeConfig fields as command-line options (--num-speculative-tokens, ...).
    defaults: field -> (another default, how the help should describe it)."""
    defaults = defaults or {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    titles = {"speculation": "speculation (sd, ssd)", "ssd": "SSD (--method ssd)"}
    for f in fields(SpeculativeConfig):
        if f.name in exclude:
            continue
        meta = dict(f.metadata)
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(
            titles[meta["group"]]))
        flags = [meta.pop("flag")] if meta.get("flag") else []
        meta.pop("flag", None)
        meta.pop("group")
        kind = {"int": int, "float": float, "int | None": int}.get(str(f.type))
        default, described = defaults.get(f.name, (f.default, "%(default)s"))
        help_text = meta.pop("help") + (f" (default: {described})" if default is not None or f.name in defaults else "")
        group.add_argument(*flags, "--" + f.name.replace("_", "-"), default=default, help=help_text,
                           **({"type": kind} if kind else {}), **meta)


def speculative_config_from_args(args: argparse.Namespace, **overrides) -> SpeculativeConfig:
    """The SpeculativeConfig the options of `add_speculative_arguments` describe."""
    given = {f.name: getattr(args, f.name) for f in fields(SpeculativeConfig) if hasattr(args, f.name)}
    return SpeculativeConfig(**{**given, **overrides})
