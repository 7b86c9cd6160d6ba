"""A twin (saguaro.models.twin) decodes as its source: the default model widened 576 -> 768
(query heads 9 -> 16 over kv heads 3 -> 4, so each kv head serves more query heads than in the
source; FFN 1536 -> 2048; one extra layer), in fp32 on real prompts, as a GGUF file of the
source's Q4_1 blocks and built in memory. Its logits along the source's greedy continuations
are the source's to fp32 rounding (the norms and the longer sums round differently), and its
greedy continuations are the source's, except where the source's two best tokens are a
near-tie. Controls: without the norms' rescaling, or with the query heads moved to other kv
heads, the logits are far off and the continuations part where no near-tie explains it."""
from __future__ import annotations

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.engine.runner import forward_chunks
from saguaro.models.kv_cache import new_cache
from saguaro.models.loader import load_model
from saguaro.models.twin import TwinShape, layout, load_twin, write_twin_gguf

SHAPE = TwinShape(hidden_size=768, num_heads=16, num_kv_heads=4, intermediate_size=2048, num_layers=31)
NEW_TOKENS = 24
NEAR_TIE = 0.01  # the source's best two logits closer than this: fp32 rounding may pick either


def greedy(path, prompts, target) -> list[list[int]]:
    with LLM(str(path), method="ar", target=target) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outputs]


def logits_along(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The logits predicting each token of `output` after `prompt`."""
    ids = prompt + output
    with torch.inference_mode():
        cache = new_cache(model, 1, len(ids))
        return model.logits(forward_chunks(model, cache, [0], [ids], [0])[0]).float()[len(prompt) - 1:-1]


@pytest.fixture(scope="module")
def real_prompts(prompts):
    return prompts[:3]


@pytest.fixture(scope="module")
def source(smollm2_path, real_prompts):
    """The source in fp32, its greedy continuations and its logits along them."""
    model = load_model(smollm2_path, torch.float32, "cpu", "none")
    outputs = greedy(smollm2_path, real_prompts, model)
    return outputs, [logits_along(model, p, o) for p, o in zip(real_prompts, outputs)]


def compare(twin, smollm2_path, real_prompts, source) -> tuple[float, list[float | None]]:
    """The twin's largest logit difference from the source's, relative to the largest logit, and
    for each prompt where the continuations part, the source's margin between its best two
    tokens there (None where they do not part)."""
    outputs, source_logits = source
    errors, margins = [], []
    for prompt, output, expected, twin_output in zip(real_prompts, outputs, source_logits,
                                                     greedy(smollm2_path, real_prompts, twin)):
        errors.append(float((logits_along(twin, prompt, output) - expected).abs().max() / expected.abs().max()))
        parted = next((i for i, (a, b) in enumerate(zip(output, twin_output)) if a != b), None)
        top = expected[parted].topk(2).values if parted is not None else None
        margins.append(None if top is None else float(top[0] - top[1]))
    return max(errors), margins


def test_the_gguf_twin_decodes_as_its_source_on_the_same_quantization(smollm2_path, real_prompts, source, tmp_path):
    """On the source's own Q4_1 blocks, dequantized."""
    twin = load_model(write_twin_gguf(smollm2_path, tmp_path / "twin.gguf", SHAPE, progress=False), torch.float32,
                      "cpu", "none")
    assert (twin.config.hidden_size, twin.config.num_heads, twin.config.num_layers) == (768, 16, 31)
    error, margins = compare(twin, smollm2_path, real_prompts, source)
    assert error < 1e-4 and all(m is None or m < NEAR_TIE for m in margins), (error, margins)


@pytest.mark.parametrize("control", [None, {"rescale_norms": False}, {"head_placement": "contiguous"}])
def test_an_in_memory_twin_decodes_as_its_source(smollm2_path, real_prompts, source, control):
    twin = load_twin(smollm2_path, SHAPE, torch.float32, "cpu", "none", **(control or {}))
    error, margins = compare(twin, smollm2_path, real_prompts, source)
    if control is None:
        assert error < 1e-4 and all(m is None or m < NEAR_TIE for m in margins), (error, margins)
    else:
        assert error > 0.05 and any(m is not None and m > 10 * NEAR_TIE for m in margins), (error, margins)


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
