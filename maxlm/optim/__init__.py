"""The optimizer: optax transforms and the learning-rate schedules (optimizers.py), Muon
(muon.py), and the dynamic loss scale of float16 training (loss_scale.py)."""
