"""The draft shipped for the embedded target: small, exact over the full vocabulary, loadable."""
import dataclasses

import torch

from saguaro.models import hub, pairing
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
    draft = pairing.load_draft(folder, target, torch.bfloat16)
    cache = KVCache(draft.config, 1, 4, torch.bfloat16)
    logits = draft.logits(draft(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache))
    assert logits.shape == (1, 4, config.vocab_size)
    assert (torch.isfinite(logits).sum(-1) == config.head_vocab_size).all()


def test_unknown_target_has_no_default_draft():
    assert hub.default_draft("no-such-model") is None


def test_ssd_takes_the_shipped_ssd_draft_unless_a_draft_is_named(tmp_path, monkeypatch):
    from pathlib import Path

    from saguaro.models.pairing import draft_paths

    for name in ("toy", "toy-ssd"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(hub, "DRAFTS_DIR", tmp_path)
    sd = tmp_path / "toy"
    assert draft_paths("toy") == (sd, tmp_path / "toy-ssd")
    assert draft_paths("toy", draft="mine") == (Path("mine"), Path("mine"))  # the user's draft wins
    assert draft_paths("toy", ssd_draft="deep") == (sd, Path("deep"))
    assert draft_paths("other") == (None, None)  # nothing shipped, nothing named
    (tmp_path / "toy-ssd" / "model.safetensors").unlink()
    assert draft_paths("toy") == (sd, sd)  # none shipped: SD's


def test_an_eagle_draft_for_ssd_is_told_apart_from_a_standalone_one(tmp_path):
    """auto refuses an EAGLE draft as SSD's (its prefix cache serves SD's rounds too): what tells
    it apart is the checkpoint's config, read once when the draft is paired."""
    from saguaro.models.pairing import pair_draft

    config = ModelConfig.load(hub.default_draft("smollm2") / "config.json")
    for eagle in (False, True):
        folder = tmp_path / str(eagle)
        folder.mkdir()
        dataclasses.replace(config, eagle=eagle).save(folder / "config.json")
        assert pair_draft(folder, None).reads_target_features is eagle
