"""The draft shipped for the embedded target: small, exact over the full vocabulary, loadable."""
import dataclasses

import torch

from saguaro.models import hub, loader
from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel


def test_shipped_draft_is_small_and_loads_against_the_target_shape():
    folder = hub.default_draft("smollm2")
    assert folder is not None and (folder / "DATA_CARD.md").is_file()
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 25_000_000
    config = ModelConfig.load(folder / "config.json")
    assert config.head_vocab_size and config.head_vocab_size < config.vocab_size
    # a stand-in with the target's shape but no layers: the draft only borrows its embeddings
    target = LlamaModel(dataclasses.replace(config, num_layers=0, head_vocab_size=None, tie_word_embeddings=True))
    draft = loader.load_draft(folder, target, torch.bfloat16)
    cache = KVCache(draft.config, 1, 4, torch.bfloat16)
    logits = draft.logits(draft(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache))
    assert logits.shape == (1, 4, config.vocab_size)
    assert (torch.isfinite(logits).sum(-1) == config.head_vocab_size).all()


def test_unknown_target_has_no_default_draft():
    assert hub.default_draft("no-such-model") is None
