"""Load tests and benchmarks: serving client, peer runner, reports, engine benches."""
