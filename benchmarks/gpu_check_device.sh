#!/usr/bin/env bash
# gpu_check.py on a lent GPU machine, which reaches nothing outside and takes at most 64 MiB a
# call with the working tree (25 MB): the default model's GGUF (98 MB; xz saves 9%) travels in
# three parts, with the two wheels the machine lacks (gguf, llguidance), over three calls made
# back to back (a machine goes back 30 s after a call). benchmarks/README.md, "The GPU check".
#
#   here, once:         bash benchmarks/gpu_check_device.sh pack
#   there, call 1:      bash benchmarks/gpu_check_device.sh receive     carrying .gpu/a
#   there, call 2:      bash benchmarks/gpu_check_device.sh receive     carrying .gpu/b
#   there, call 3:      bash benchmarks/gpu_check_device.sh check       carrying .gpu/c, timeout_s 600
#
# `check` runs gpu_check.py within --budget-s 400 (the twin's build and the start take the rest
# of the 10 minutes a call may run) and leaves in $OUT its report, speed.md, the profiles and
# plans, and log.txt: seven files of the eight a call brings back.
set -euo pipefail
PARTS=/tmp/gpu_check_parts

case "${1:-}" in
pack)
    model=$(python3 -c 'from saguaro.models import hub; print(hub.resolve(hub.DEFAULT_MODEL))')
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.gpu/' "$exclude" || echo '/.gpu/' >> "$exclude"
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/c
    split -n 3 -d "$model" .gpu/part
    mv .gpu/part00 .gpu/a/ && mv .gpu/part01 .gpu/b/ && mv .gpu/part02 .gpu/c/
    sha256sum < "$model" > .gpu/c/model.sha256
    # the versions installed here, as wheels for the machine's Python 3.12 (llguidance: saguaro's
    # engine imports it; gguf reads the model); each call carries one part and one wheel
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/a \
        "gguf==$(python3 -m pip show gguf | sed -n 's/^Version: //p')"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        -d .gpu/b "llguidance==$(python3 -m pip show llguidance | sed -n 's/^Version: //p')"
    du -sh .gpu/a .gpu/b .gpu/c
    ;;
receive)
    mkdir -p "$PARTS"
    cp .gpu/*/part0* .gpu/*/*.whl "$PARTS"/
    ls -l "$PARTS"
    ;;
check)
    mkdir -p "$PARTS" && cp .gpu/c/* "$PARTS"/
    for part in part00 part01 part02; do
        [ -f "$PARTS/$part" ] || { echo "$part is missing (a fresh machine?): run the receive calls again"; exit 1; }
    done
    cat "$PARTS"/part00 "$PARTS"/part01 "$PARTS"/part02 > /tmp/model.gguf
    [ "$(sha256sum < /tmp/model.gguf)" = "$(cat "$PARTS"/model.sha256)" ] || { echo "the model's parts do not add up: run the receive calls again"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$PARTS"/*.whl
    export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_check.py --device cuda --model /tmp/model.gguf --out "$OUT" --budget-s 400 2>&1 | tee "$OUT/log.txt"
    ;;
*)
    echo "usage: bash benchmarks/gpu_check_device.sh pack|receive|check" >&2
    exit 2
    ;;
esac
