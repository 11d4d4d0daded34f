# syntax=docker/dockerfile:1.7
# megatron_marsrl on an NGC PyTorch image, for H100/H200 clusters (torchrun or Slurm).
#
#   docker build -t marsrl .
#   docker build -t marsrl --build-arg NGC_TAG=26.10-py3 --build-arg SGLANG_VERSION=0.5.24 .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 marsrl selfcheck
#
# Status: checked by tests/test_dockerfile.py (pinned base, every version ARG used, pins equal to
# requirements/, entry point), but never built or run: the development machines have no Docker
# engine and no GPU. See README.md, "Container".
#
# Base: NGC PyTorch 26.09 ships torch 2.14.0a0 (nv26.09), CUDA 13, Python 3.12, Transformer
# Engine and apex. It is the release whose torch minor matches sglang 0.5.23's torch==2.14.1 pin
# (26.07 ships 2.13), so SGLang's compiled kernels (built for torch 2.14) and its CUDA-13 wheels
# (flashinfer[cu13], cutlass-dsl[cu13], cuda-python>=13) fit the image. The image's torch is kept:
# Transformer Engine and apex are compiled against it. Unverified until a GPU build: that
# sglang-kernel's binaries (built against torch 2.14.1) load against the image's 2.14.0a0, and
# that the image's pip constraints (/etc/pip/constraint.txt) leave these pins resolvable.
ARG NGC_TAG=26.09-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

# Defaults equal requirements/gpu.txt (tests/test_dockerfile.py checks).
ARG SGLANG_VERSION=0.5.23
ARG MCORE_VERSION=0.19.2
ARG MODELOPT_VERSION=0.47.0
ARG TRANSFORMERS_VERSION=5.19.0
ARG MATH_VERIFY_VERSION=0.9.0
ARG TENSORBOARD_VERSION=2.21.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# SGLang and three of its kernel packages pin torch==2.14.1 from PyPI; resolving them normally
# would replace the image's torch 2.14.0a0 and break TE and apex. Those four are installed without
# dependencies, then SGLang's other requirements (read from its own metadata) without torch and
# torchvision (the image's) and torchaudio (audio models only). The quoted heredoc leaves every
# $ to bash, which sees the ARGs as environment variables.
RUN <<"EOF"
set -euo pipefail
image_torch=$(python -c "import torch; print(torch.__version__)")
pip install --no-deps "sglang==${SGLANG_VERSION}"
python - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement

from_image = {"torch", "torchvision", "torchaudio"}
no_deps = {"sglang-kernel", "sgl-deep-ep", "sgl-flash-mla"}  # each pins torch==2.14.1 itself
with open("/tmp/sglang-deps.txt", "w") as deps, open("/tmp/sglang-nodeps.txt", "w") as nodeps:
    for line in md.requires("sglang"):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # optional extras and other platforms
        name = req.name.lower().replace("_", "-")
        if name not in from_image:
            req.marker = None
            print(req, file=nodeps if name in no_deps else deps)
PY
pip install --no-deps -r /tmp/sglang-nodeps.txt
pins=(
  "megatron-core==${MCORE_VERSION}"
  "nvidia-modelopt[torch]==${MODELOPT_VERSION}"
  "transformers==${TRANSFORMERS_VERSION}"
  "math-verify==${MATH_VERIFY_VERSION}"
  "tensorboard==${TENSORBOARD_VERSION}"
)
pip install -r /tmp/sglang-deps.txt "${pins[@]}"
rm /tmp/sglang-deps.txt /tmp/sglang-nodeps.txt
now_torch=$(python -c "import torch; print(torch.__version__)")
[ "$now_torch" = "$image_torch" ] || { echo "torch changed: $image_torch -> $now_torch" >&2; exit 1; }
EOF

# Only what the package, its examples and tools need (no .git, outputs or caches).
WORKDIR /opt/megatron_marsrl
COPY setup.py README.md ./
COPY megatron_marsrl ./megatron_marsrl
COPY examples ./examples
COPY tools ./tools
RUN pip install . \
    && marsrl --version \
    && python -c "import sglang, megatron.core, modelopt, math_verify, tensorboard"

WORKDIR /workspace
ENTRYPOINT ["marsrl"]
CMD ["--help"]
