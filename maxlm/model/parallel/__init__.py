"""Schedules that split one model across devices beyond sharded weights: context parallelism
(ring attention with its blocks and zigzag load balance, Ulysses all-to-all) and the pipeline
over the `stage` axis."""
