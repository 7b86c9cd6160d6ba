"""A GGUF file's tokenizer, converted once by transformers and read back from the cache with the
`tokenizers` library alone (saguaro.models.tokenizer): the same ids, text and chat prompts as
transformers' tokenizer, on real prompts, and no transformers import on the way."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from saguaro.datasets import humaneval_prompts, sharegpt_conversations
from saguaro.models import tokenizer as folder_tokenizer
from saguaro.models.tokenizer import FolderTokenizer, _transformers_tokenizer, load_tokenizer

# written the way many Hub templates are (Llama 3's, Qwen's): one block tag a line, indented
INDENTED_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'system' %}
        {{ bos_token + '[SYS] ' + message['content'] | trim + '\\n' }}
    {% else %}
        {{ '[' + message['role'] | upper + '] ' + message['content'] | tojson + eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{ '[ASSISTANT] ' }}
{% endif %}
"""


@pytest.fixture(scope="module")
def pair(smollm2_path, tmp_path_factory):
    """(the cached folder's tokenizer, transformers' tokenizer converted from the file)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SAGUARO_CACHE", str(cache))
        cached = load_tokenizer(smollm2_path)
    assert isinstance(cached, FolderTokenizer) and str(cache) in cached.name_or_path
    return cached, _transformers_tokenizer(smollm2_path.parent, smollm2_path.name)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    chats = itertools.islice((c for c in sharegpt_conversations() if c), 40)
    return humaneval_prompts()[:20] + [c[0]["content"] for c in chats] + ["ünïcode, 中文, emoji 🌵\n\n\ttabs  "]


def test_ids_and_text_are_transformers(pair, texts):
    ours, theirs = pair
    for text in texts:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ours.encode(text) == ids
        for part in (ids, ids[3:11], ids[-5:]):  # slices start and end inside words and characters
            assert ours.decode(part) == theirs.decode(part)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (theirs.eos_token_id, theirs.bos_token_id, len(theirs))
    assert ours.get_vocab() == theirs.get_vocab()
    tokens = ours.convert_ids_to_tokens(list(range(len(ours))))
    assert tokens == theirs.convert_ids_to_tokens(list(range(len(theirs))))
    spelled = tokens[::97] + ["<not-a-token>", "Ġthe"]
    assert ours.convert_tokens_to_ids(spelled) == theirs.convert_tokens_to_ids(spelled)
    assert ours.convert_tokens_to_ids("Ġthe") == theirs.convert_tokens_to_ids("Ġthe")


def test_chat_prompts_are_transformers(pair):
    ours, theirs = pair
    chats = list(itertools.islice((c for c in sharegpt_conversations() if len(c) >= 3), 20))
    chats.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}])
    for chat in chats:
        for messages in (chat[:1], chat[:3]):
            ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == ids
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
            assert ours.apply_chat_template(messages, tokenize=False) == \
                theirs.apply_chat_template(messages, tokenize=False)


def test_an_indented_template_renders_as_in_transformers(pair, tmp_path, monkeypatch):
    """Block tags on lines of their own need the environment's trimming (trim_blocks,
    lstrip_blocks), special tokens and tojson; control: without the trimming the text differs."""
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast(tokenizer_object=pair[0].backend, bos_token="<|im_start|>",
                                     eos_token="<|im_end|>")
    theirs.chat_template = INDENTED_TEMPLATE
    theirs.save_pretrained(str(tmp_path))
    ours = FolderTokenizer(tmp_path)
    chat = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": 'Say "hi" — ünï'}]
    expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == expected

    def untrimmed_environment():
        environment = make_environment()
        environment.trim_blocks = environment.lstrip_blocks = False
        return environment

    make_environment = folder_tokenizer.chat_environment
    monkeypatch.setattr(folder_tokenizer, "chat_environment", untrimmed_environment)
    control = FolderTokenizer(tmp_path).apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert control != expected


def test_a_cached_tokenizer_loads_without_transformers(smollm2_path, pair):
    """What makes a second start fast: transformers (1.5-2 s to import) is never imported."""
    code = ("import sys; from saguaro.models.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(smollm2_path)!r}); print('transformers' in sys.modules)")
    env_cache = str(Path(pair[0].name_or_path).parent.parent)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "SAGUARO_CACHE": env_cache})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_a_saved_folder_reads_back_in_transformers(pair, texts, tmp_path):
    from transformers import AutoTokenizer

    ours, _ = pair
    ours.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": texts[-1]}]
    assert [again(t)["input_ids"] for t in texts] == [ours.encode(t) for t in texts]
    assert again.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (again.eos_token_id, again.bos_token_id) == (ours.eos_token_id, ours.bos_token_id)
