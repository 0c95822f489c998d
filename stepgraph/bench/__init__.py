"""`stepgraph bench`: timing helpers, modes, peers, rows, plots."""
