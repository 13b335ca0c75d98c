"""The per-op microbenchmarks (`make bench` runs them through benchmarks.run) and the CPU paths' accuracy."""
