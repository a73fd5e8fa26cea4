"""The trainer's processes: how they start (the launcher, a run on this machine), share the CPUs, watch
their launcher, stop for preemption and end with one exit code and one line."""
