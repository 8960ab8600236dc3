"""All runtime SQL, hand-written, one module per table it owns.

Each function takes an open psycopg connection and runs inside the caller's
transaction; the caller (api/, through backend/) decides where transactions begin and end.
"""
