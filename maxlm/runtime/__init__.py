"""What every layer of maxlm may use: its error types, console output, progress lines, paths
(local or gs://), subprocess helpers, and the multi-controller runtime (`jax.distributed`)."""
