"""How a statement finds a user's rows: by `bucket` and `user_id`, together.

Every table about users has both columns (schema.bucket_column). A statement
about one user names both (`bucket = %(bucket)s AND user_id = %(user)s`), one
about several users names their buckets too (`bucket = ANY(%(buckets)s) AND
user_id = ANY(%(users)s)`), and an insert writes both; a join of two such
tables joins on both. Written that way once, a statement runs as it is on
plain PostgreSQL (which finds the rows by `user_id`) and on Citus (which
routes it to the shard of its bucket, citus.py). The parameters come from
`user_key` and `users_key`, so the bucket named is always the user's.
"""

import hashlib
from collections.abc import Iterable
from typing import Any

BUCKETS = 64
"""How many buckets users are spread over. Part of the layout (migration 0012's
agent_inbox_bucket): changing it means re-bucketing every row."""


BUCKET_FUNCTION = f"""
CREATE OR REPLACE FUNCTION agent_inbox_bucket(user_id text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS
$$ SELECT (('x' || substr(md5(user_id), 1, 7))::bit(28)::int) % {BUCKETS} $$
"""
"""`bucket` in SQL, as migration 0012 creates it (and `citus.distribute` on a
database laid out before it)."""


def bucket(user: str) -> int:
    """The bucket of `user`; equal to agent_inbox_bucket(user) in SQL."""
    return int(hashlib.md5(user.encode("utf-8")).hexdigest()[:7], 16) % BUCKETS


def user_key(user: str | None, **params: Any) -> dict[str, Any]:
    """`params` with `user` and its `bucket`: a statement about one user (or,
    with None, an operator's view about every user: both None)."""
    return {"user": user, "bucket": None if user is None else bucket(user), **params}


def users_key(users: Iterable[str], **params: Any) -> dict[str, Any]:
    """`params` with `users` (a list) and their `buckets`: a statement about
    several users (on Citus, users of one bucket: citus.by_bucket)."""
    users = list(users)
    return {"users": users, "buckets": sorted({bucket(user) for user in users}), **params}
