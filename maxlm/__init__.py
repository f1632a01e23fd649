"""maxlm: pretraining decoder-only Transformers with JAX, Flax, optax, grain and orbax.

The package, by concern, in layers from the bottom (docs/architecture.md#module-map):

    runtime/      errors, console, paths, processes, jax.distributed: what every layer may use
    config/       the config: defaults, rules, mesh axes (no JAX)
    model/ data/  the Transformer as pure functions of (config, params, batch); config → source →
                  tokenize and pack → step-indexed batches
    optim/ hf/    optax optimizers and schedules; Hugging Face import and export
    sharding/     the device mesh and the train state's shardings
    observe/      metrics, the step log, the monitor, FLOPs, goodput, the profiler
    resilience/   fault handling: non-finite steps, loss spikes, preemption, the data position
    checkpoint/   orbax saves, the local tier, the workdir lock, a finished run read back
    generate/ eval/  sampling with a KV cache; the loss, tasks and lm-evaluation-harness
    train/        the loop and the step
    cli.py and the commands: `python -m maxlm.{train,data,bench,checkpoint,eval,generate,export,plot}`
    bench/        tools that measure and compare (never imported by training)

Importing maxlm has no side effects: commands set what the process needs (maxlm/cli.py).
"""
