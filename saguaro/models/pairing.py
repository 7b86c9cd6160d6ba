"""A target and the drafts that go with it, found and checked once: the model a user names
(a known name, a GGUF file or a folder), its shipped or named drafts, and whether each draft
speaks the target's tokenizer. LLM, the decoder builder and SSD's workers take the result as
given instead of finding paths and reading tokenizers again."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.models import graphs, hub
from saguaro.models.checkpoint import draft_embeddings, has_own_embeddings, is_saguaro_checkpoint, load_checkpoint
from saguaro.models.config import ModelConfig
from saguaro.models.gguf_file import read_gguf_file
from saguaro.models.hub import checkpoint_files
from saguaro.models.llama import LlamaModel
from saguaro.models.loader import load_model
from saguaro.models.packed import PackedLinear
from saguaro.models.tokenizer import load_tokenizer


class IncompatibleDraftError(ValueError):
    """The draft cannot run with this target: different tokenizers, vocabularies or embedding widths."""


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
    loaded = load_draft(draft.path, target, tokens=draft.tokens, config=draft.config)
    return graphs.attach(loaded, target.cuda_graphs)


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


def load_draft(path: str | Path, target: LlamaModel, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None, tokens: int | None = None,
               config: ModelConfig | None = None) -> LlamaModel:
    """A draft for `target`: a saguaro checkpoint (embeddings borrowed from the target when the
    draft omits them) or any other checkpoint load_model reads. Vocabularies must match, or be
    one tokenizer's of `tokens` tokens (match_tokenizers') padded to different numbers of rows
    (fit_vocabulary). It is quantized as the target was (build.quantized_projections), where it
    runs in the target's dtype. config: a saguaro checkpoint's config.json, where the caller has
    read it (DraftPairing)."""
    dtype, device = dtype or target.dtype, device or target.device
    quantization = target.quantization if dtype == target.dtype else None
    if config is not None or is_saguaro_checkpoint(path):
        config = config or ModelConfig.load(Path(path) / "config.json")
        _check_vocab(config, target.config, path)
        embeddings = draft_embeddings(target)
        if config.hidden_size != embeddings.shape[1] and not has_own_embeddings(path):
            raise IncompatibleDraftError(
                f"draft {path} borrows the target's embeddings but its width {config.hidden_size} "
                f"differs from the target's {embeddings.shape[1]}")
        return load_checkpoint(path, dtype, device, embeddings=embeddings, quantization=quantization, config=config)
    draft = load_model(path, dtype, device, quantization)
    if tokens is None:
        _check_vocab(draft.config, target.config, path)
        return draft
    return fit_vocabulary(draft, target.config.vocab_size, tokens)


def fit_vocabulary(draft: LlamaModel, rows: int, tokens: int) -> LlamaModel:
    """A draft whose vocabulary is padded to other than the target's `rows`, both of one
    tokenizer's `tokens` tokens (Qwen 2.5's small models have 151,936 rows, its large ones
    152,064, for 151,665 tokens), made to speak the target's: its embedding padded with zero
    rows or cut to `rows`, and its head predicting the token ids below both (a reduced head: its
    distributions are widened to the target's vocabulary with zeros, so verification stays
    exact)."""
    config = draft.config
    if config.vocab_size == rows:
        return draft
    if min(config.vocab_size, rows) < tokens:
        raise IncompatibleDraftError(f"the draft's vocabulary has {config.vocab_size} rows and the target's {rows}, "
                                     f"for a tokenizer of {tokens} tokens")
    if config.head_vocab_size is not None:
        head_ids = draft.head_token_ids
        if int(head_ids.max()) >= rows:
            raise IncompatibleDraftError(f"the draft's head predicts token ids up to {int(head_ids.max())}, past "
                                         f"the target's {rows} rows")
    else:
        shared = min(config.vocab_size, rows)
        head_ids = torch.arange(shared, device=draft.device)
        if shared < config.vocab_size:  # the head's rows past the target's vocabulary are cut
            draft.set_submodule("lm_head", _cut_head(draft.lm_head, shared, config.vocab_size, rows))
    draft.refit_vocabulary(rows, head_ids)
    return draft


def _cut_head(head: torch.nn.Module, shared: int, draft_rows: int, target_rows: int) -> torch.nn.Module:
    """A float head's first `shared` rows, packed as it was."""
    packed = isinstance(head, PackedLinear)
    if not packed and type(head) is not torch.nn.Linear:
        raise IncompatibleDraftError(
            f"the draft's vocabulary ({draft_rows} rows) is padded beyond the target's ({target_rows}) and "
            "its quantized head cannot be cut: load it with quantization 'none'")
    cut = torch.nn.Linear(head.in_features, shared, bias=False, device="meta",
                          dtype=head.weight.dtype).requires_grad_(False)
    cut.load_state_dict({"weight": head.weight[:shared]}, assign=True)
    return PackedLinear(cut) if packed else cut


def _check_vocab(draft: ModelConfig, target: ModelConfig, path) -> None:
    if draft.vocab_size != target.vocab_size:
        raise IncompatibleDraftError(
            f"draft {path} has a vocabulary of {draft.vocab_size} tokens, the target {target.vocab_size}: "
            "speculative decoding needs the same tokenizer")


def tokenizer_identity(path: str | Path, tokenizer=None) -> tuple[list[str], int | None, int | None] | None:
    """(token strings by id, BOS id, EOS id) of a checkpoint's tokenizer: a GGUF file's
    `tokenizer.ggml.*` metadata or a Hugging Face folder's tokenizer (`tokenizer`, where the
    caller has loaded it); None for a checkpoint without a tokenizer of its own (saguaro's
    drafts, weights saved alone)."""
    if is_saguaro_checkpoint(path):
        return None
    folder, gguf_file = checkpoint_files(Path(path))
    if gguf_file is not None:
        fields = read_gguf_file(gguf_file).fields
        if "tokenizer.ggml.tokens" not in fields:
            return None
        return (list(fields["tokenizer.ggml.tokens"]), fields.get("tokenizer.ggml.bos_token_id"),
                fields.get("tokenizer.ggml.eos_token_id"))
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    tokenizer = tokenizer or load_tokenizer(path)
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))), tokenizer.bos_token_id, tokenizer.eos_token_id
