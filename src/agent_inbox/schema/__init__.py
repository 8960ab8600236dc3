"""The schema (layer 4): `model` (the tables, as SQLAlchemy metadata), `migrate`
(Alembic, to head), `revision` (is this database at head, and laid out for the
backend the code expects).
"""
