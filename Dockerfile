# The agent-inbox CLI on PostgreSQL: `docker run IMAGE migrate --database-url ...`.
# Every option also reads AGENT_INBOX_<OPTION> from the environment.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# The runtime user, created before the sources are copied so this layer stays cached.
RUN groupadd --system --gid 10001 agent-inbox \
 && useradd --system --uid 10001 --gid agent-inbox --create-home \
        --home-dir /home/agent-inbox --shell /usr/sbin/nologin agent-inbox

# Only what `pip install .` reads: the metadata (pyproject.toml names README.md
# as the readme), the package and the Alembic tree shipped as agent_inbox.migrations.
WORKDIR /build
COPY pyproject.toml README.md ./
COPY src/ src/
COPY migrations/ migrations/
# "binary" brings libpq in a wheel, so the slim image needs no system libpq.
# The pip cache lives in a BuildKit cache mount: reused across builds, not in the image.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[binary]"

USER 10001:10001
WORKDIR /home/agent-inbox

ENTRYPOINT ["agent-inbox"]
CMD ["--help"]
