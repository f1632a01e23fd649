"""Where a resume continues in the data: the position is a batch index, so its rows depend on the
keys in `data.STREAM_KEYS` (batch_size, seq_len, seed, the source, mixture, tokenizer, filters).

Each checkpoint's meta records those keys and the row stream's index of the next batch
(`record`). A resume in which one changed follows `data.resume_position`:
  same    refused: exit 2 naming the keys (`check`), before anything compiles;
  tokens  continues after the tokens already read: the recorded rows (times the recorded seq_len,
          divided by the new one) give the new stream's row, and the first batch at or after it
          is read next. With only batch_size changed (a batch ramp-up) this is exact within the
          epoch: no row is read twice and at most one batch's worth is passed over;
  start   the new stream from its first batch (e.g. a new mixture for an annealing phase).
The step, and with it the lr schedule, goes on either way. The jump is an entry of the skip list
(maxlm/train/anomaly.py), so later resumes land on the same batches.
"""

from __future__ import annotations

import logging

from maxlm.data import STREAM_KEYS
from maxlm.errors import ConfigError
from maxlm.train import metrics

log = logging.getLogger("maxlm")


def stream_keys(config_dict: dict) -> dict:
    """{dotted key: value} of STREAM_KEYS in a config dict, sections such as `data.filters` by
    their keys, and tuples as JSON text (`metrics.flatten_config`), as the meta records them."""
    return {key: value for key, value in metrics.flatten_config(config_dict).items()
            if any(key == k or key.startswith(k + ".") for k in STREAM_KEYS)}


def record(cfg, dataset, position: int) -> dict:
    """What a checkpoint's meta records about the data (`{"data": ...}`)."""
    return {"data": {"keys": stream_keys(cfg.to_dict()), "rows": dataset.first_row(position)}}


def changes(recorded: dict, cfg) -> list[str]:
    """`KEY=NOW (checkpoint: SAVED)` for each stream key that differs from the recorded ones."""
    now = stream_keys(cfg.to_dict())
    return [f"{k}={now.get(k)!r} (checkpoint: {recorded.get(k)!r})" for k in sorted(set(now) | set(recorded))
            if now.get(k) != recorded.get(k)]


def check(recorded: dict, cfg, path: str) -> None:
    """ConfigError when the stream keys `recorded` by the checkpoint at `path` differ from `cfg`'s
    and `data.resume_position` is "same"."""
    differ = changes(recorded, cfg)
    if differ and cfg.data.resume_position == "same":
        raise ConfigError(
            f"the checkpoint {path} read its data with other settings: {', '.join(differ)}; resuming would read "
            "other rows at the same data position. Resume with the checkpoint's settings, or choose "
            "data.resume_position=tokens (continue after the tokens already read: a batch ramp-up) or "
            "data.resume_position=start (the new data from its beginning)")


def continued(meta: dict, cfg, dataset, path: str) -> int | None:
    """The data position the restored step reads under `data.resume_position` when the stream
    keys changed since the checkpoint (`meta`: its meta), else None (nothing changed, or a
    checkpoint that recorded nothing)."""
    recorded = meta.get("data")
    if not recorded:
        return None
    check(recorded["keys"], cfg, path)
    differ = changes(recorded["keys"], cfg)
    if not differ:
        return None
    if cfg.data.resume_position == "start":
        position = 0
    else:  # tokens: the rows read so far, as rows of the new length
        row = -(-recorded["rows"] * recorded["keys"]["seq_len"] // cfg.seq_len)
        position = dataset.position_at_row(row)
    log.info("data changed since the checkpoint (%s): data.resume_position=%s reads data position %d next",
             ", ".join(differ), cfg.data.resume_position, position)
    return position
