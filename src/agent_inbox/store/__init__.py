"""All runtime SQL, hand-written, one module per table it owns.

Each function takes an open psycopg connection and runs inside the caller's
transaction; the caller (api/, through backend/) decides where transactions begin and end.
"""

from typing import TypeVar, cast

import psycopg

Row = TypeVar("Row")


def one(cursor: psycopg.Cursor[Row]) -> Row:
    """The row of a statement that always answers one (an aggregate, an
    upsert's RETURNING, a SELECT of the clock): `cursor.fetchone()`, typed
    without the None it never is (nothing is checked: as before, a missing row
    fails where it is indexed)."""
    return cast(Row, cursor.fetchone())
