"""Where a run's models come from: the hub (the models stage), a local folder checked before use, the
reference architectures' configs, random-weight and tiny models for tests, demos and benchmarks."""
