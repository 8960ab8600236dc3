"""HTTP intake for provider webhooks: verify the sender's signature, then store
the delivery once with `Inbox.ingest`, and acknowledge.

Invariant: nothing reaches the inbox unless its signature verified against the
secret configured for that user and source; secrets are never logged or echoed.

Modules: `signatures` (pure HMAC checks), `secrets` (the secrets file and its
SIGHUP reload), `app` (the Starlette application), `command` (the
`agent-inbox ingest-server` command).
"""

# Shared defaults (here so that importing the command does not import Starlette).
DEFAULT_MAX_BODY = 1 << 20  # 1 MiB
DEFAULT_STRIPE_TOLERANCE = 300  # seconds
# The transport's limits (ingest/transport.py), per server process.
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request's headers
DEFAULT_BODY_TIMEOUT = 10.0  # seconds for a whole body, after its headers
DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_MAX_BUFFERED = 32 << 20  # 32 MiB of requests held at once
