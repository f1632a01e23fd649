"""What a run reports: the metrics files, the step log line, the live monitor, MoE router
statistics, FLOPs and MFU, goodput, and the profiler."""
