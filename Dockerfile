# megatron_marsrl on an NGC PyTorch image (GPU clusters). Not buildable on the CPU
# development machines (no Docker engine there); the GPU recipes issue completes it.
#   docker build -t marsrl --build-arg SGLANG_VERSION=0.5.23 .
#   docker run --gpus all --ipc=host marsrl --help
ARG NGC_TAG=25.11-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ARG SGLANG_VERSION=0.5.23
ARG MCORE_VERSION=0.19.2
ARG MODELOPT_VERSION=0.39.0

# The image ships torch, Transformer Engine and apex; keep its torch.
RUN pip install --no-cache-dir "sglang==${SGLANG_VERSION}" "megatron-core==${MCORE_VERSION}" \
        "nvidia-modelopt[torch]==${MODELOPT_VERSION}" math-verify==0.9.0 tensorboard==2.21.0

WORKDIR /opt/megatron_marsrl
COPY . .
RUN pip install --no-cache-dir --no-deps .

ENTRYPOINT ["marsrl"]
CMD ["--help"]
