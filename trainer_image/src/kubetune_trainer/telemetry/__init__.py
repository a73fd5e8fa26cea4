"""What a run tells while it trains: log lines and the progress bar, Prometheus metrics and the endpoint
the operator reads, the progress pushed to it, MLflow, each step's phases and readout, profiling."""
