"""A tokenizer folder (tokenizer.json, tokenizer_config.json, its chat template) read with the
`tokenizers` library alone.

Importing transformers takes 1.5-2 s, as long as repacking a 1 GB model; its fast tokenizers are
this same Rust tokenizer underneath. Folders saguaro wrote itself (a GGUF file's converted
tokenizer in the cache) are read this way; other folders keep transformers' AutoTokenizer, whose
per-model classes may adjust what a folder says.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from saguaro.models.hub import cache_dir, checkpoint_files

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken's fields."""
    return value.get("content") if isinstance(value, dict) else value


class FolderTokenizer:
    """What saguaro asks of a tokenizer (encode, decode, the chat template, the special tokens),
    with the results of transformers' fast tokenizer on the same folder."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.name_or_path = str(folder)
        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.config = config = json.loads((folder / "tokenizer_config.json").read_text())
        template_file = folder / "chat_template.jinja"
        self.chat_template: str | None = (template_file.read_text() if template_file.is_file()
                                          else config.get("chat_template"))
        self.special_tokens = {name: text for name in SPECIAL_TOKENS
                               if (text := _token_text(config.get(name))) is not None}

    def _id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Ids of token strings; a string not in the vocabulary gets the unknown token's id."""
        if isinstance(tokens, str):
            found = self.backend.token_to_id(tokens)
            return self._id("unk_token") if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def save_pretrained(self, folder: str | Path) -> None:
        """A folder that this class, and transformers' AutoTokenizer, read back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if k != "chat_template"}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        if self.chat_template is not None:
            (folder / "chat_template.jinja").write_text(self.chat_template)

    @cached_property
    def _template(self):
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template: give the prompt as text or token ids")
        return chat_environment().from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **variables) -> str | list[int]:
        """The conversation as the template renders it (tokens without BOS / EOS added: the
        template writes its own); `variables`: more that the template reads."""
        text = self._template.render(**{**self.special_tokens, **variables}, messages=[dict(m) for m in messages],
                                     tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def chat_environment():
    """A sandboxed Jinja environment with the settings and helpers chat templates are written
    for (Hugging Face's: blocks trimmed, `raise_exception`, `strftime_now`, an unescaped `tojson`)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


def load_tokenizer(path: str | Path):
    """A tokenizer, chat template included, from a folder or a GGUF file.

    Building one from a GGUF file's vocabulary takes seconds (transformers converts it anew),
    so the result is kept in the cache as a tokenizer folder, keyed by the file's name, size
    and modification time, and read from there, without transformers, next time."""
    folder, gguf_file = checkpoint_files(Path(path))
    if gguf_file is None:
        return _transformers_tokenizer(folder)
    stat = gguf_file.stat()
    cached = cache_dir() / "tokenizers" / f"{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not cached.is_dir():
        tokenizer = _transformers_tokenizer(folder, gguf_file.name)
        if not _save_atomically(tokenizer, cached):
            return tokenizer
    return FolderTokenizer(cached)


def _transformers_tokenizer(folder: Path, gguf_name: str | None = None):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        try:
            return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_name)
        except ValueError:  # an architecture transformers' GGUF reader lacks (SmolLM3): its tokenizer alone
            if gguf_name is None:
                raise
            return PreTrainedTokenizerFast.from_pretrained(str(folder), gguf_file=gguf_name)
    finally:
        logging.set_verbosity(verbosity)


def _save_atomically(tokenizer, folder: Path) -> bool:
    """Writes next to `folder` and renames, so a reader never sees half a tokenizer. False where
    the cache cannot be written (which only costs the next load its speed)."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(folder)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        return False
    return True
