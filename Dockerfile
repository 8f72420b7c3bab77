FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN scripts/install
ENV PATH=/app/.venv/bin:$PATH
RUN python manage.py lmsp_prepare_models
