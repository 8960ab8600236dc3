"""The chaos suite: real worker, scheduler and dispatcher processes, in network
namespaces, against a throwaway PostgreSQL, under kills, stalls, partitions and a
server restart; every guarantee is then checked from the database alone."""
