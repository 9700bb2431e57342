"""The accounting rules: pure values and functions, no I/O.

Nothing here imports gRPC, SQL or OpenTelemetry (checked by import-linter).
Times are integer microseconds since the Unix epoch; amounts are integer nanos.
"""
