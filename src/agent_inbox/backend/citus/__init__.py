"""Citus, by job: `nodes` (routing a bucket to its worker node, node pools),
`statements` (per-bucket statements of the run path), `functions` (the run
path's functions installed on every node), `layout` (distributing the schema,
detection).
"""
