"""maxlm: pretraining decoder-only Transformers with JAX, Flax, optax, grain and orbax.

The package, by concern (README.md has the module map):

    config.py, config_rules.py, axes.py   the config: defaults, rules, mesh axes (no JAX)
    model/     the Transformer as pure functions of (config, params, batch)
    data/      config → source → tokenize and pack → step-indexed batches
    train/     the training spine: mesh, state, step, loop, checkpoints, faults, eval
    hf/        Hugging Face interop (import and export)
    bench/     tools that measure and compare (never imported by training)
    cli.py and the commands: `python -m maxlm.{train,data,bench,checkpoint,eval,generate,export,plot}`

Importing maxlm has no side effects: commands set what the process needs (maxlm/cli.py).
"""
