"""Placing the training state on the device mesh: the jax Mesh built from the config's axes
(mesh.py) and the train state with its shardings (state.py)."""
