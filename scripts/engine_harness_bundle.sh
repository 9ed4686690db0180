#!/usr/bin/env bash
# Builds .ci/engines-gpu: what `scripts/gpu-check.sh engines` needs to run SGLang 0.5.23's own
# GroupCoordinator on the device machine, which has torch 2.11 and Python 3.12 but no network:
# SGLang's Python sources and JIT headers (from the released wheel, none of its cp311 binaries)
# and cp312 wheels of the pure-Python packages its parallel_state imports. Run it here (it
# downloads), then carry .ci/engines-gpu and .ci/wheels. About 50 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.ci/engines-gpu
rm -rf "$bundle" && mkdir -p "$bundle/deps" .ci/engines
ls .ci/engines/sglang-0.5.23-*.whl >/dev/null 2>&1 ||
  python3 -m pip download --quiet --no-deps sglang==0.5.23 -d .ci/engines
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$bundle/deps" orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm ipython \
  aiohttp apache-tvm-ffi
python3 - "$bundle/sglang-0.5.23-src.zip" .ci/engines/sglang-0.5.23-*.whl <<'EOF'
import sys, zipfile
out, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
    for name in src.namelist():
        jit = name.startswith("sglang/kernels/jit/") and ("/include/" in name or "/csrc/" in name)
        if (name.startswith("sglang/") and name.endswith(".py")) or jit:
            dst.writestr(name, src.read(name))
EOF
du -sh "$bundle"
