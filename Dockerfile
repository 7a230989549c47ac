# One image for every kvmesh service: `docker run kvmesh kvmesh serve <service>`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# gcc builds kernels/cpu_ops.c (the float32 CPU decode kernels) on first use; without it the
# engine runs its slower pure-torch path
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU wheel index: its own layer, cached across source changes
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
COPY loadgen ./loadgen
COPY kvmesh ./kvmesh
RUN pip install . && useradd --create-home --uid 10001 kvmesh

USER kvmesh
EXPOSE 8000
CMD ["kvmesh", "--help"]
