"""Drafts as LlamaModels: a reduced head with exact full-vocabulary logits, and saguaro
checkpoints that borrow the target's embeddings."""
import dataclasses

import pytest
import torch

from saguaro.distill.draft import DraftSpec, init_draft
from saguaro.models import checkpoint, hub, loader, pairing
from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel


def tiny(vocab: int = 50, **changes) -> LlamaModel:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, **changes)
    return LlamaModel(config).eval().requires_grad_(False)


def run(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, 1, len(tokens), model.dtype)
    n = len(tokens)
    return model.logits(model(torch.tensor([tokens]), torch.arange(n)[None], cache))[0]


def test_reduced_head_is_exact_over_the_full_vocabulary():
    target = tiny()
    vocab = torch.tensor([0, 3, 7, 9, 20, 49])
    draft = init_draft(target, DraftSpec(layers=(0, 2), head_vocab=len(vocab)), vocab)
    logits = run(draft, [1, 3, 7, 2])
    assert logits.shape == (4, 50) and logits.dtype == torch.float32
    outside = torch.ones(50, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(logits[:, outside]).all() and (logits[:, outside] < 0).all()
    assert torch.isfinite(logits[:, vocab]).all()
    probs = logits.softmax(-1)
    assert probs[:, outside].sum() == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_reduced_head_cannot_be_tied():
    with pytest.raises(ValueError, match="tied"):
        tiny(head_vocab_size=10)


def test_draft_checkpoint_round_trip_without_embeddings(tmp_path):
    target = tiny()
    draft = init_draft(target, DraftSpec(layers=(1,), head_vocab=8), torch.arange(0, 40, 5))
    with torch.no_grad():
        draft.layers[0].mlp.down_proj.weight.add_(0.01)  # differ from the target's layer
    checkpoint.save_checkpoint(draft, tmp_path / "draft", dtype=torch.float32)
    from safetensors import safe_open
    with safe_open(tmp_path / "draft" / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
    loaded = pairing.load_draft(tmp_path / "draft", target)
    assert loaded.config == draft.config
    torch.testing.assert_close(run(loaded, [4, 5, 6]), run(draft, [4, 5, 6]))
    with pytest.raises(hub.ModelNotFoundError, match="load_draft"):
        loader.load_model(tmp_path / "draft")


def test_full_checkpoint_loads_on_its_own(tmp_path):
    model = tiny()
    checkpoint.save_checkpoint(model, tmp_path / "m", dtype=torch.float32, share_embeddings=False)
    torch.testing.assert_close(run(loader.load_model(tmp_path / "m"), [1, 2]), run(model, [1, 2]))


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    target = tiny()
    other = tiny(vocab=60)
    checkpoint.save_checkpoint(other, tmp_path / "other", share_embeddings=False)
    with pytest.raises(pairing.IncompatibleDraftError, match="vocabulary"):
        pairing.load_draft(tmp_path / "other", target)


def test_shared_embeddings_need_the_same_width(tmp_path):
    target = tiny()
    narrow = LlamaModel(dataclasses.replace(target.config, hidden_size=16, num_heads=2, num_kv_heads=1))
    checkpoint.save_checkpoint(narrow, tmp_path / "narrow")
    with pytest.raises(pairing.IncompatibleDraftError, match="width"):
        pairing.load_draft(tmp_path / "narrow", target)
