FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN scripts/install
ENV PATH=/app/.venv/bin:$PATH
# A build step, not a service: the built-in secret key is fine for it.
RUN LMSP_DEVELOPMENT=1 python manage.py lmsp_prepare_models
