#!/bin/bash
# The pure-Python (and cp312 manylinux) wheels the lent GPU machine lacks, into .whl/pd (git-ignored,
# carried by the device tool: `carry: [".whl"]`). The machine has torch, triton and transformers,
# Python 3.12, and no registry. Run here, once:  bash bench/device/fetch-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl/pd
# ninja: DeepEP's parallel build on the GPU machine (bench/device/build-deepep.sh)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl/pd ninja
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl/pd \
  annotated_doc==0.0.7 annotated_types==0.8.0 anyio==4.16.0 certifi click fastapi==0.165.0 \
  grpcio==1.85.3 grpcio_health_checking==1.85.1 h11 httpcore httptools httpx idna iniconfig \
  opentelemetry_api orjson packaging pluggy py_spy prometheus_client protobuf==7.36.2 pydantic==2.14.4 \
  pydantic_core==2.50.5 pygments pytest pytest_timeout pyyaml sniffio starlette==1.10.0 \
  typing_extensions typing_inspection uvicorn==0.54.0
# The grammar engine (binary wheels: xgrammar links apache-tvm-ffi) and llguidance for
# bench/grammar.py's comparison.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform any -d .whl/pd \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 jsonschema jsonschema_specifications \
  referencing rpds_py attrs
ls .whl/pd | wc -l
