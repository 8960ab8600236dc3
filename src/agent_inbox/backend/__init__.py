"""How the run path's transactions are cut (layer 3): `path` holds the
`RunPath` protocol, the plain server's set-based path and the chooser; `citus/`
the per-bucket path and everything else that only a Citus database needs.
"""
