"""Shared fixtures. Loading the default model takes seconds, so each model is loaded once per
test session and every test that needs it shares it."""
from __future__ import annotations

import os

import pytest
import torch

# method="auto" would start from, and leave, a profile in the user's cache: each test starts fresh.
os.environ["SAGUARO_AUTO_PROFILE"] = "0"
if os.environ.get("PYTEST_XDIST_WORKER"):  # two test processes on two cores: one thread each, not four
    torch.set_num_threads(1)

NEW_TOKENS = 64


@pytest.fixture
def machine_threads():
    """torch on as many threads as the process has cores, for tests of how SSD shares them (the
    test processes run one thread each); restored after."""
    from saguaro.system import usable_cores

    before = torch.get_num_threads()
    torch.set_num_threads(len(usable_cores()))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path():
    from saguaro.models import hub

    return hub.resolve("smollm2")


@pytest.fixture(scope="session")
def llm():
    """The embedded default target in fp32, where greedy near-ties are rare (docs/DESIGN.md, section 4)."""
    from saguaro import LLM

    return LLM("smollm2", method="ar", dtype="float32")


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """The same GGUF checkpoint loaded by Hugging Face transformers: the reference."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def prompts(llm) -> list[list[int]]:
    """20 real prompts as token ids: 10 HumanEval code prompts (raw) and 10 held-out ShareGPT
    first turns (chat template applied), alternating so that any prefix mixes both kinds."""
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    code = [llm.encode(p) for p in humaneval_prompts()[:10]]
    chat = [llm.encode([{"role": "user", "content": p}])
            for p in sharegpt_first_turns("heldout", limit=10, seed=0, max_chars=1000)]
    return [p for pair in zip(code, chat) for p in pair]


@pytest.fixture(scope="session")
def ar_greedy(llm, prompts) -> list[list[int]]:
    """saguaro's AR greedy continuations of `prompts`, decoded as one batch."""
    from saguaro import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outputs]
