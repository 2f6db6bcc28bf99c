# syntax=docker/dockerfile:1.7
# CoSine: one image for all five services; the argument picks the service.
#   docker build -t cosine:0.1.0 .                                          # CPU torch
#   docker build -t cosine:0.1.0-cuda --build-arg VARIANT=cuda .            # CUDA torch, same version
#   docker build -t cosine:0.1.0 --build-arg PREPARE_MODELS=true .          # bake the zoo's models in
#   docker run --rm -p 50051:50051 -e COSINE_ROUTER_HOST=0.0.0.0 cosine:0.1.0 serve router
# The Helm chart (helm/cosine) runs `cosine serve <service>` and configures it by COSINE_<SERVICE>_* variables.

# ---- build: a virtual environment with torch (CPU or CUDA build) and the cosine package
FROM python:3.11-slim-bookworm AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# the CUDA build of torch comes with its CUDA runtime as wheels: the nodes need only the NVIDIA driver
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG PREPARE_MODELS=false
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN if [ "$VARIANT" = "cuda" ]; then index="$TORCH_CUDA_INDEX"; else index="$TORCH_CPU_INDEX"; fi \
 && pip install --index-url "$index" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml ./
COPY README* ./
COPY services ./services
COPY protos ./protos
# torch is already the wanted build: the pin torch==2.13.0 is satisfied by 2.13.0+cpu / +cu128
RUN pip install . && pip check
# CoSine's CPU kernels (engine/csrc: matmul, attention, decoder step), compiled here where a compiler is; the runtime stage has none.
# It picks its instructions at run time (AVX-512, AVX512-BF16), so the image runs on any x86-64 node.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && COSINE_KERNELS_DIR=/opt/cosine/kernels python -m cosine.engine.kernels
# optional: models prepared at build time (needs the package index at build time, not at run time)
RUN mkdir -p /opt/cosine/cache \
 && if [ "$PREPARE_MODELS" = "true" ]; then COSINE_CACHE=/opt/cosine/cache cosine zoo prepare; fi

# ---- runtime: the interpreter, the virtual environment and nothing to build with
FROM python:3.11-slim-bookworm AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="cosine" \
      org.opencontainers.image.description="CoSine speculative-decoding services (router, scheduler, fusion, drafter, verifier)" \
      io.cosine.variant="${VARIANT}"
RUN groupadd --gid 10001 cosine \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin cosine \
 && mkdir -p /var/cache/cosine && chown 10001:10001 /var/cache/cosine
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/cosine /opt/cosine
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    COSINE_CACHE=/var/cache/cosine \
    COSINE_KERNELS_DIR=/opt/cosine/kernels \
    TOKENIZERS_PARALLELISM=false
WORKDIR /tmp
USER 10001:10001
EXPOSE 50051 50052 50053 50054 50060
# checkov:skip=CKV_DOCKER_2: health is gRPC (grpc.health.v1 "liveness"/"readiness") on a per-service port; Kubernetes probes it natively and Docker's HEALTHCHECK cannot
ENTRYPOINT ["cosine"]
CMD ["serve", "router"]
