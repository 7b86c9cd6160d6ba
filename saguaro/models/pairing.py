"""A target and the drafts that go with it, found and checked once: the model a user names
(a known name, a GGUF file or a folder), its shipped or named drafts, and whether each draft
speaks the target's tokenizer. LLM, the decoder builder and SSD's workers take the result as
given instead of finding paths and reading tokenizers again."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from saguaro.models import graphs, hub
from saguaro.models.config import ModelConfig
from saguaro.models.llama import LlamaModel
from saguaro.models.loader import (IncompatibleDraftError, is_saguaro_checkpoint, load_draft, load_tokenizer,
                                   tokenizer_identity)

TokenizerIdentity = tuple[list[str], int | None, int | None]  # token strings by id, BOS id, EOS id


@dataclass(frozen=True)
class DraftPairing:
    """A draft checked against its target's tokenizer. tokens: the number of tokens of the
    tokenizer both share, to which a vocabulary padded to other rows is fitted (None where the
    draft has no tokenizer of its own: its vocabulary is checked when it loads). config: a
    saguaro checkpoint's config.json, read here once (None for other checkpoints)."""
    path: Path
    tokens: int | None = None
    config: ModelConfig | None = None

    @property
    def reads_target_features(self) -> bool:
        """Whether the draft is EAGLE-style, reading the target's hidden states."""
        return self.config is not None and self.config.eagle


@dataclass(frozen=True)
class ResolvedModel:
    """A target found once. name: as the user gave it (a known name picks its shipped drafts);
    tokenizer: the target's, loaded once; draft: SD's (and auto's) draft; ssd_draft: the one
    SSD's workers run (SD's unless one of its own is named or shipped). Both None where no draft
    was asked for or none exists."""
    name: str
    path: Path
    tokenizer: object
    draft: DraftPairing | None = None
    ssd_draft: DraftPairing | None = None


def resolve_model(name: str, draft: str | None = None, ssd_draft: str | None = None,
                  speculate: bool = True) -> ResolvedModel:
    """The target `name`, its tokenizer and, where `speculate`, its drafts (see draft_paths),
    each checked against the target's tokenizer."""
    path = hub.resolve(name)
    tokenizer = load_tokenizer(path)
    sd_path, ssd_path = draft_paths(str(name), draft, ssd_draft) if speculate else (None, None)
    if sd_path is None:
        return ResolvedModel(str(name), path, tokenizer)
    target_tokenizer = tokenizer_identity(path, tokenizer)
    sd = pair_draft(sd_path, target_tokenizer)
    return ResolvedModel(str(name), path, tokenizer, sd,
                         sd if ssd_path == sd_path else pair_draft(ssd_path, target_tokenizer))


def draft_paths(name: str, draft: str | None = None, ssd_draft: str | None = None) -> tuple[Path | None, Path | None]:
    """(SD's draft, SSD's draft): `draft`, else the one shipped for the target `name` (None
    where there is none); `ssd_draft`, else (where no draft was named) the deeper one shipped
    for SSD, else SD's."""
    sd_path = hub.resolve(draft) if draft else hub.default_draft(name)
    if sd_path is None:
        return None, None
    if ssd_draft:
        return sd_path, hub.resolve(ssd_draft)
    return sd_path, (None if draft else hub.default_draft(name, ssd=True)) or sd_path


def load_paired_draft(model: ResolvedModel, target: LlamaModel) -> LlamaModel | None:
    """SD's draft of `model`, loaded to run in this process beside `target` (None: it has none)."""
    draft = model.draft
    if draft is None:
        return None
    return graphs.attach(load_draft(draft.path, target, tokens=draft.tokens, config=draft.config), target.cuda_graphs)


def pair_draft(path: Path, target_tokenizer: TokenizerIdentity | None) -> DraftPairing:
    """The draft at `path`, its tokenizer checked against the target's (see match_tokenizers)."""
    config = ModelConfig.load(path / "config.json") if is_saguaro_checkpoint(path) else None
    tokens = None if config is not None else match_tokenizers(tokenizer_identity(path), target_tokenizer)
    return DraftPairing(path, tokens, config)


def match_tokenizers(draft: TokenizerIdentity | None, target: TokenizerIdentity | None) -> int | None:
    """Raises IncompatibleDraftError where the draft's tokenizer differs from the target's: in
    its number of tokens, in any token's string, or in its BOS or EOS id. Returns the number of
    tokens they share; None where either has no tokenizer of its own, which is left to
    load_draft's vocabulary check."""
    if draft is None or target is None:
        return None
    (draft_tokens, *draft_special), (target_tokens, *target_special) = draft, target
    if len(draft_tokens) != len(target_tokens):
        raise IncompatibleDraftError(
            f"the draft's vocabulary has {len(draft_tokens)} tokens, the target's tokenizer "
            f"{len(target_tokens)}: speculative decoding needs the same tokenizer")
    if draft_tokens != target_tokens:
        token = next(i for i, (a, b) in enumerate(zip(draft_tokens, target_tokens)) if a != b)
        raise IncompatibleDraftError(
            f"token {token} is {draft_tokens[token]!r} in the draft and {target_tokens[token]!r} in the "
            "target: speculative decoding needs the same tokenizer")
    for name, ours, theirs in zip(("BOS", "EOS"), draft_special, target_special):
        if ours != theirs:
            raise IncompatibleDraftError(f"{name} is {ours} in the draft and {theirs} in the target: "
                                         "speculative decoding needs the same special tokens")
    return len(target_tokens)
