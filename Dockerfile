# The lmsp image: web, workers and ops all run from it (see compose.yaml).
#   docker build --build-arg TORCH=cpu .     # CPU torch (the default)
#   docker build --build-arg TORCH=cu128 .   # CUDA 12.8 torch, for GPU workers
# TORCH names a build on download.pytorch.org/whl (cpu, cu126, cu128, ...).
FROM python:3.11-slim
ARG TORCH=cpu
# Plain HTTP by default; behind a proxy that terminates TLS, set
# LMSP_BEHIND_TLS_PROXY=1, LMSP_TRUSTED_PROXIES and LMSP_CSRF_TRUSTED_ORIGINS
# (README, "Operations").
ENV PYTHONUNBUFFERED=1 \
    LMSP_DATA_DIR=/data \
    LMSP_MODEL_CACHE=/app/models \
    LMSP_BEHIND_TLS_PROXY=0 \
    LMSP_HSTS_SECONDS=0
WORKDIR /app
# A C compiler: a worker builds its decoding attention for the CPU it runs on
# (README, "The engine"); without one it falls back to torch's, slower.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY . .
RUN TORCH_INDEX_URL="https://download.pytorch.org/whl/${TORCH}" scripts/install
ENV PATH=/app/.venv/bin:$PATH
# The default model, converted once into the image (no hub download at run time).
# A build step, not a service: the built-in secret key is fine for it.
RUN LMSP_DEVELOPMENT=1 python manage.py lmsp_prepare_models
RUN useradd --system --create-home lmsp && mkdir -p /data && chown lmsp /data
USER lmsp
