"""The benchmark behind `make bench` (docs/benchmarks.md).

Every figure is measured side by side with a bare gRPC echo service driven by
the same load generator in the same run, and reported as a ratio to it: on a
shared machine the absolute numbers move, the ratios much less.
"""
