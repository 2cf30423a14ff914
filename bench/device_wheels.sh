#!/usr/bin/env bash
# The wheels a device call carries (.whl/, git-ignored): what tests/ and the server need beyond the
# device image's packages (KINDS.md lists those), at the versions this checkout tests against, with
# every dependency the image lacks named (s21: huggingface_hub 2.4 / openai 3.57 need httpx2, fastapi
# 0.165 needs opentelemetry-api; s22: openai needs sniffio; without them the imports failed there).
#   bash bench/device_wheels.sh      (then carry [".whl"]; bench/gpu_call.sh installs them)
#   bash bench/device_wheels.sh --lean   (.whl/ without the OpenAI client: what fits the carry beside the tree now)
#   bash bench/device_wheels.sh --bench   (.whlb/: llguidance alone, what `import dhisparse.engine` needs beyond
#                                          the image; for bench-only calls, carry [".whlb", ".tcache"]: the tree, all
#                                          of .whl and the Triton cache do not fit the 64-MiB carry together, s37)
set -euo pipefail
cd "$(dirname "$0")/.."
P=""; for t in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux_2_39; do
  P="$P --platform ${t}_x86_64"; done
if [ "${1:-}" = "--bench" ]; then
  mkdir -p .whlb
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .whlb llguidance==1.9.1
  du -sh .whlb
  exit 0
fi
# --lean: without the OpenAI client (openai, jiter, distro: 2.7 MB; the tests that drive the server through it
# skip on the device, tests/conftest.py). The tracked tree reached 53 MB in session 39 (bench/results 28 MB, the
# tiny-code checkpoints 21 MB), and with the full .whl (14 MB) it passed the 64-MiB carry.
CLIENT="openai==3.57.0 distro jiter==0.19.0"
[ "${1:-}" = "--lean" ] && CLIENT=""
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .whl \
  transformers==5.24.0 huggingface_hub==2.4.0 dflash==0.1.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 annotated-doc \
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  $CLIENT sniffio httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 idna==3.20 anyio==4.16.0 \
  llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
python3 bench/slim_wheel.py .whl/transformers-5.24.0-py3-none-any.whl
du -sh .whl
