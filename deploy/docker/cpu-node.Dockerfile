# syntax=docker/dockerfile:1
# tandem-cpu-node image: a CPU attention node (tandem.v1.CpuAttention on :50061).
#
# Build context: the repository root; BuildKit (Docker >= 23, or DOCKER_BUILDKIT=1) reads
# deploy/docker/cpu-node.Dockerfile.dockerignore beside this file to trim it:
#   docker build -f deploy/docker/cpu-node.Dockerfile -t tandem-cpu-node:0.1.0 .

FROM debian:12 AS builder
# scripts/setup.sh is the one list of Debian build packages; copied alone first so that the
# package layer stays cached across source edits.
COPY scripts/setup.sh /src/scripts/setup.sh
RUN bash /src/scripts/setup.sh && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_ENABLE_CUDA=OFF \
      -DTANDEM_BUILD_TESTS=OFF -DTANDEM_BUILD_BENCH=OFF \
 && cmake --build /build --target tandem-cpu-attention \
 && strip /build/services/tandem-cpu-attention

FROM debian:12-slim
# The Debian 12 packages of the shared libraries tandem-cpu-attention links (ldd + dpkg -S):
# abseil, c-ares, oneDNN (+ its OpenMP runtime and OpenCL loader), fmt, gRPC (+ re2, OpenSSL,
# zlib), protobuf, spdlog, libstdc++.
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      libabsl20220623 libc-ares2 libdnnl2 libfmt9 libgcc-s1 libgomp1 libgrpc++1.51 libgrpc29 \
      libprotobuf32 libre2-9 libspdlog1.10 libssl3 libstdc++6 ocl-icd-libopencl1 zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin tandem
COPY --from=builder /build/services/tandem-cpu-attention /usr/local/bin/tandem-cpu-attention
# Fails the build, naming the library, when the package list above misses one.
RUN if ldd /usr/local/bin/tandem-cpu-attention | grep 'not found'; then \
      echo 'a shared library is missing from the image' >&2; exit 1; \
    fi
USER 10001:10001
EXPOSE 50061
ENTRYPOINT ["/usr/local/bin/tandem-cpu-attention"]
CMD ["--address=0.0.0.0:50061"]
