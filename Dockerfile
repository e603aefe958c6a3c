# syntax=docker/dockerfile:1
# The pdserve image: the project installed from pyproject.toml with pip into a virtual
# environment (as `make` does, without the test extras), `pdserve` as the entrypoint, run as an
# unprivileged user. The Helm chart (k8s/pdserve) runs `pdserve router|worker|make-model ...`
# with this entrypoint and the ports exposed below.
#
#   docker build -t pdserve:0.1.0 .                                  # CPU: PyTorch's CPU wheels
#   docker build --build-arg VARIANT=cuda -t pdserve:0.1.0-cuda .    # CUDA: PyPI's CUDA wheels + Triton
#
# The CUDA variant needs only the NVIDIA driver on the node (the container toolkit mounts it):
# the CUDA runtime, cuBLAS and NCCL come inside the torch wheels.
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# The compiler builds the native CPU kernels here, at install; the runtime stage has none.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv && pip install --upgrade pip 'setuptools>=68'
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine engine
COPY kernels kernels
COPY services services
COPY pdserve pdserve
COPY modelkit modelkit
# torch at the version pyproject.toml pins: from PyTorch's CPU index for the CPU variant (no
# CUDA libraries), from PyPI (CUDA bundled) for the CUDA one; then the project itself, with NIXL
# (the KV data plane between workers; its wheel takes the torch already installed), built
# against that torch (no build isolation): setup.py compiles the native CPU kernels for every ISA
# level. `pdserve kernels --check` fails the build unless each level's library is in the venv
# and this CPU's loads.
RUN TORCH="torch==$(sed -n 's/^ *"torch==\([^"]*\)",.*/\1/p' pyproject.toml | head -n 1)" \
    && case "$VARIANT" in \
         cpu) pip install --index-url https://download.pytorch.org/whl/cpu "$TORCH" ;; \
         cuda) pip install "$TORCH" ;; \
         *) echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 1 ;; \
       esac \
    && pip install --no-build-isolation '.[nixl]' \
    && cd / && pdserve kernels --check

FROM ${PYTHON_IMAGE}
ARG VARIANT
# Triton builds its small launcher with the system C compiler the first time a kernel runs on a GPU.
RUN if [ "$VARIANT" = cuda ]; then \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdserve \
    && mkdir -p /models && chown 10001:10001 /models
COPY --from=build /opt/venv /opt/venv
# HOME and caches under /tmp: the chart mounts a writable /tmp over a read-only root filesystem.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    PDSERVE_MODEL_DIR=/models
WORKDIR /tmp
USER 10001
# router gRPC and HTTP; worker gRPC, metrics, torch.distributed rendezvous (rank 0)
EXPOSE 50051 8000
EXPOSE 50061 9100 29500
ENTRYPOINT ["pdserve"]
# Alone (no chart): the whole stack on the tiny model, reachable from outside the container.
CMD ["serve", "--host", "0.0.0.0"]
