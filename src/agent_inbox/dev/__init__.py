"""Tooling for a developer's machine, not the runtime: `pgserver` (a throwaway
PostgreSQL from the local binaries), `demo` (the reference's eight failure
scenarios), `examples` (what the example agents share). Above the services and
below the command line, whose `demo` command runs it.
"""
