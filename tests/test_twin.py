"""A twin (saguaro.models.twin) decodes as its source: the default model widened 576 -> 768
(query heads 9 -> 16 over kv heads 3 -> 4, so each kv head serves more query heads than in the
source; FFN 1536 -> 2048; one extra layer), greedy on real prompts, as a GGUF file of the
source's Q4_1 blocks and built in memory. Controls: without the norms' rescaling, or with the
query heads moved to other kv heads, the twin decodes differently."""
from __future__ import annotations

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.models.loader import load_model
from saguaro.models.twin import TwinShape, layout, load_twin, write_twin_gguf

SHAPE = TwinShape(hidden_size=768, num_heads=16, num_kv_heads=4, intermediate_size=2048, num_layers=31)
NEW_TOKENS = 32


def source_model(path):
    """fp32, where the norms' rescaling rounds far below greedy's margins (in bf16 a twin, like
    any change of rounding, can flip a near-tie)."""
    return load_model(path, torch.float32, "cpu", "none")


def greedy(path, prompts, target=None) -> list[list[int]]:
    with LLM(str(path), method="ar", target=target) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def real_prompts(prompts):
    return prompts[:4]


def test_the_gguf_twin_decodes_as_its_source_on_the_same_quantization(smollm2_path, real_prompts, tmp_path):
    """On the source's own Q4_1 blocks, dequantized."""
    twin = write_twin_gguf(smollm2_path, tmp_path / "twin.gguf", SHAPE, progress=False)
    model = load_model(twin, torch.float32, "cpu", "none")
    assert (model.config.hidden_size, model.config.num_heads, model.config.num_layers) == (768, 16, 31)
    assert greedy(twin, real_prompts, model) == greedy(smollm2_path, real_prompts, source_model(smollm2_path))


@pytest.mark.parametrize("control", [None, {"rescale_norms": False}, {"head_placement": "contiguous"}])
def test_an_in_memory_twin_decodes_as_its_source(smollm2_path, real_prompts, control):
    source = greedy(smollm2_path, real_prompts, source_model(smollm2_path))
    twin = load_twin(smollm2_path, SHAPE, torch.float32, "cpu", "none", **(control or {}))
    same = [t == s for t, s in zip(greedy(smollm2_path, real_prompts, twin), source)]
    assert all(same) if control is None else not any(same[:3]) or sum(same) <= len(same) // 2


def test_bad_shapes_are_refused_naming_the_width(smollm2_path):
    from saguaro.models.loader import read_checkpoint

    config, _ = read_checkpoint(smollm2_path)
    with pytest.raises(ValueError, match="hidden_size 512 is smaller"):
        layout(config, TwinShape(512, 9, 3, 1536))
    with pytest.raises(ValueError, match="fewer than the source's 3"):
        layout(config, TwinShape(768, 12, 6, 2048))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        layout(config, TwinShape(768, 12, 5, 2048))


def test_the_command_writes_a_twin_and_refuses_a_bad_shape(smollm2_path, tmp_path, capsys):
    from saguaro.cli import main
    from saguaro.models.loader import read_checkpoint

    assert main(["twin", str(smollm2_path), str(tmp_path / "t.gguf"), "--shape", "640,12,4,1600"]) == 0
    source, _ = read_checkpoint(smollm2_path)
    config, _ = read_checkpoint(tmp_path / "t.gguf")
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (640, 12, 4, 64)
    assert config.rms_norm_eps == pytest.approx(source.rms_norm_eps * 576 / 640)
    assert main(["twin", str(smollm2_path), str(tmp_path / "u.gguf"), "--shape", "640,10"]) == 1
    assert "HIDDEN,HEADS,KV_HEADS,FFN" in capsys.readouterr().err
