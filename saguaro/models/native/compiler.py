"""Compiles saguaro's kernels (group_matmul.c, decoder_layer.c, repack.c, token_mask.c) with the
system C compiler, once per source and compiler: the library is cached under saguaro's cache folder, keyed
by both, so later starts load it in milliseconds. It needs a C compiler (`$CC`, else `cc`) with
OpenMP; each build is compiled the first time it is tried (see bindings.library)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from saguaro.models.hub import cache_dir

SOURCES = ("group_matmul.c", "decoder_layer.c", "repack.c", "token_mask.c")
HEADERS = ("group_matmul_avx2.h", "decoder_layer_avx2.h")
# the builds tried in turn, the widest first: (name, compiler flags)
BUILDS = (("avx512", ()), ("avx2", ("-DSAGUARO_AVX2",)))


class NativeUnavailable(RuntimeError):
    pass


def library_path(build: str, flags: tuple[str, ...], folder: Path = Path(__file__).parent) -> Path:
    """The build compiled from the sources in folder (benchmarks/tile_rows.py compares other folders')."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C compiler ({compiler!r} not found; set $CC)")
    sources = [folder / name for name in SOURCES]
    source = b"".join(path.read_bytes() for path in sources + [folder / name for name in HEADERS])
    key = hashlib.sha256(source + compiler.encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"saguaro-{build}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-fopenmp", *flags, *map(str, sources),
                                     "-o", str(built), "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeUnavailable(f"{compiler} failed: {result.stderr.strip()[-500:]}")
            os.replace(built, path)  # atomic: a concurrent start sees the whole file or none
    return path
