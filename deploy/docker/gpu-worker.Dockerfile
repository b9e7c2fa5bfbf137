# syntax=docker/dockerfile:1
# tandem-gpu-worker image: the GPU worker (tandem.v1.Generation on :50051) and the tandem CLI.
#
# Build context: the repository root; BuildKit (Docker >= 23, or DOCKER_BUILDKIT=1) reads
# deploy/docker/gpu-worker.Dockerfile.dockerignore beside this file to trim it:
#   docker build -f deploy/docker/gpu-worker.Dockerfile -t tandem-gpu-worker:0.1.0 .
#   docker build ... --build-arg CUDA_ARCHS="90;100" .      # more GPU generations
#
# Runs on a node with an NVIDIA driver for CUDA 13 (>= 580) and the NVIDIA container toolkit /
# Kubernetes device plugin, which mount the driver's libcuda into the container.
#
# NOTE: the builder is Debian 12 with NVIDIA's CUDA 13.0 packages for Debian 12, not the
# nvidia/cuda:*-devel-ubuntu24.04 image: tandem uses oneDNN's 2.x API (dnnl::matmul::desc),
# which oneDNN 3 removed, and Ubuntu 24.04 ships only oneDNN 3.1 (libdnnl3). Debian 12 has
# oneDNN 2.6 and every other package at the versions scripts/setup.sh installs and CI tests.
# The binaries need glibc >= 2.36; the runtime image's Ubuntu 24.04 has 2.39.

# 13.0.1 = the toolkit tandem is built and tested with (nvcc V13.0.88, CUDA 13.0 Update 1).
ARG CUDA_VERSION=13.0.1

FROM debian:12 AS builder
ARG CUDA_VERSION
ARG CUDA_ARCHS=90
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# NVIDIA's apt repository for Debian 12 (cuda-keyring holds its signing key and source list).
ARG CUDA_REPO=https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64
ADD ${CUDA_REPO}/cuda-keyring_1.1-1_all.deb /tmp/cuda-keyring.deb
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends ca-certificates \
 && dpkg -i /tmp/cuda-keyring.deb \
 && apt-get update -q \
 && cuda_pkg=$(cut -d. -f1,2 <<< "${CUDA_VERSION}" | tr . -) \
 && apt-get install -y -q --no-install-recommends \
      "cuda-minimal-build-${cuda_pkg}" "cuda-cccl-${cuda_pkg}" "libcublas-dev-${cuda_pkg}" \
 && rm -rf /var/lib/apt/lists/*
# scripts/setup.sh is the one list of Debian build packages; copied alone first so that the
# package layer stays cached across source edits.
COPY scripts/setup.sh /src/scripts/setup.sh
RUN bash /src/scripts/setup.sh && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN cuda_home=/usr/local/cuda-$(cut -d. -f1,2 <<< "${CUDA_VERSION}") \
 && cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DTANDEM_ENABLE_CUDA=ON -DTANDEM_CUDA_ARCHS="${CUDA_ARCHS}" \
      -DCMAKE_CUDA_COMPILER="${cuda_home}/bin/nvcc" -DCUDAToolkit_ROOT="${cuda_home}" \
      -DTANDEM_BUILD_TESTS=OFF -DTANDEM_BUILD_BENCH=OFF \
 && cmake --build /build --target tandem-gpu-worker tandem \
 && mkdir -p /out/bin /out/lib \
 && cp /build/services/tandem-gpu-worker /build/services/tandem /out/bin/ \
 && strip /out/bin/* \
 && cp /build/lib/libtandem_sentencepiece.so /out/lib/ \
 && sh /src/deploy/docker/collect-runtime-libs.sh /out/lib \
      /out/bin/tandem-gpu-worker /out/bin/tandem /out/lib/libtandem_sentencepiece.so

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
# /opt/tandem/lib holds the Debian 12 libraries the binaries link (gRPC, protobuf, abseil,
# oneDNN, ...) and the dlopen'ed SentencePiece shim, which the worker looks for in
# <executable dir>/../lib. The loader searches it after the image's own directories (zz-), so a
# library Ubuntu also has (zlib, OpenSSL, libgomp: same soname, same or newer) stays Ubuntu's.
COPY --from=builder /out/bin/ /opt/tandem/bin/
COPY --from=builder /out/lib/ /opt/tandem/lib/
RUN echo /opt/tandem/lib > /etc/ld.so.conf.d/zz-tandem.conf \
 && ldconfig \
 && if ldd /opt/tandem/bin/tandem-gpu-worker /opt/tandem/bin/tandem \
         /opt/tandem/lib/libtandem_sentencepiece.so | grep 'not found'; then \
      echo 'a shared library is missing from the image' >&2; exit 1; \
    fi \
 && groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
ENV PATH=/opt/tandem/bin:${PATH}
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["/opt/tandem/bin/tandem-gpu-worker"]
CMD ["--help"]
