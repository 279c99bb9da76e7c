# The shop (gunicorn) and Locust image used by docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, so editing the shop does not reinstall them. The `shop` extra
# brings dj-database-url and psycopg (DATABASE_URL, PostgreSQL); `load` brings
# gunicorn and Locust.
COPY pyproject.toml README.md LICENSE ./
COPY redlock_django/ redlock_django/
RUN pip install ".[shop,load]"

# The Django project and the Locust scenarios run from /app (not installed).
COPY manage.py ./
COPY shop/ shop/
COPY loadtests/ loadtests/
COPY deploy/healthcheck.py deploy/healthcheck.py

RUN useradd --system --uid 10001 --no-create-home shop
USER shop

EXPOSE 8000
# Three sync workers per replica; --worker-tmp-dir keeps their heartbeat files in
# memory (a container's /tmp may sit on a slow overlay filesystem).
CMD ["gunicorn", "shop.wsgi:application", "--bind", "0.0.0.0:8000", \
     "--workers", "3", "--worker-tmp-dir", "/dev/shm", "--timeout", "60"]
