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


def test_ssd_takes_the_shipped_ssd_draft_unless_a_draft_is_named(tmp_path, monkeypatch):
    from pathlib import Path

    from saguaro.config import SpeculativeConfig
    from saguaro.speculation.build import ssd_draft_path

    for name in ("toy", "toy-ssd"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(hub, "DRAFTS_DIR", tmp_path)
    sd = hub.default_draft("toy")
    assert ssd_draft_path(SpeculativeConfig(), "toy", sd) == tmp_path / "toy-ssd"
    named = Path("mine")
    assert ssd_draft_path(SpeculativeConfig(draft="mine"), "toy", named) == named  # the user's draft wins
    assert ssd_draft_path(SpeculativeConfig(ssd_draft="deep"), "toy", sd) == Path("deep")
    (tmp_path / "toy-ssd" / "model.safetensors").unlink()
    assert ssd_draft_path(SpeculativeConfig(), "toy", sd) == sd  # none shipped: SD's


def test_an_eagle_draft_for_ssd_is_told_apart_from_a_standalone_one(tmp_path):
    """auto refuses an EAGLE draft as SSD's (its prefix cache serves SD's rounds too): what tells
    it apart is the checkpoint's config."""
    from saguaro.speculation.build import reads_target_features

    config = ModelConfig.load(hub.default_draft("smollm2") / "config.json")
    for eagle in (False, True):
        folder = tmp_path / str(eagle)
        folder.mkdir()
        dataclasses.replace(config, eagle=eagle).save(folder / "config.json")
        assert reads_target_features(folder) is eagle
    assert not reads_target_features(tmp_path / "model.gguf")  # a file: no config of its own
