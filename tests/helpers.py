"""Shared test helpers: loading configs/*.py and building synthetic packed batches."""

import importlib.util
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def with_overrides(cfg, overrides: dict):
    """Sets dotted keys ("optim.lr") on `cfg`, as `--config.optim.lr=...` would."""
    for key, value in overrides.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return cfg


def packed_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0, docs_per_row: int = 3):
    """Random tokens packed as `docs_per_row` documents per row (positions restart per document)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
    bounds = np.sort(rng.choice(np.arange(1, seq_len), size=(batch_size, docs_per_row - 1)), axis=1)
    segment_ids = np.ones((batch_size, seq_len), np.int32)
    positions = np.zeros((batch_size, seq_len), np.int32)
    for b in range(batch_size):
        starts = [0, *bounds[b].tolist()]
        for i, start in enumerate(starts):
            segment_ids[b, start:] = i + 1
        for start, end in zip(starts, [*starts[1:], seq_len]):
            positions[b, start:end] = np.arange(end - start)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segment_ids,
        "positions": positions,
    }
