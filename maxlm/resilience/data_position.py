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
(maxlm/resilience/anomaly.py), so later resumes land on the same batches.

The meta also records each source's fingerprint (its files' names, sizes and modification times,
as the packed cache's key holds them: `data.source_fingerprints`): files added to, removed from or
edited in a source since the checkpoint are a change like a stream key's, under the same rules. A
checkpoint from before fingerprints were recorded compares its keys alone.

`seq_len` changes only to extend the context: together with the position encoding's settings
(`model.rope_theta`, `model.rope_scaling` and its parameters: `encoding`), whatever
`data.resume_position` says. A seq_len change alone is taken for an accident and refused (exit 2).
"""

from __future__ import annotations

import logging

from maxlm import config as config_lib
from maxlm.data import STREAM_KEYS, source_fingerprints
from maxlm.observe import metrics
from maxlm.runtime.errors import ConfigError

log = logging.getLogger("maxlm")


def stream_keys(config_dict: dict) -> dict:
    """{dotted key: value} of STREAM_KEYS in a config dict, sections such as `data.filters` by
    their keys, and tuples as JSON text (`metrics.flatten_config`), as the meta records them."""
    return {key: value for key, value in metrics.flatten_config(config_dict).items()
            if any(key == k or key.startswith(k + ".") for k in STREAM_KEYS)}


def encoding(config_dict: dict) -> dict:
    """{dotted key: value} of the position encoding's settings: `model.positions` and the
    `model.rope_*` keys (theta, the scaling and its parameters)."""
    return {key: value for key, value in metrics.flatten_config(config_dict).items()
            if key == "model.positions" or key.startswith("model.rope_")}


def record(cfg, dataset, position: int) -> dict:
    """What a checkpoint's meta records about the data (`{"data": ...}`), and the position
    encoding it was read with (a seq_len change needs a new one: `check`)."""
    return {"data": {"keys": stream_keys(cfg.to_dict()), "rows": dataset.first_row(position),
                     "encoding": encoding(cfg.to_dict()), "fingerprints": dataset.source_fingerprints}}


def edited(recorded: dict | None, now: dict) -> list[str]:
    """A line for each source whose fingerprint differs between those `recorded` by a checkpoint
    (None: an older checkpoint that recorded none: nothing to compare) and those `now`; a source
    in one of them only is a `data.source` or `data.mixture` change, which `changes` names."""
    return [f"the files of data source {name!r} (fingerprint {now[name]}, checkpoint: {recorded[name]}: files "
            "added, removed or edited since)" for name in sorted(set(recorded or {}) & set(now))
            if recorded[name] != now[name]]


def edited_since(path: str, recorded_data: dict, cfg) -> list[str]:
    """`edited` for the checkpoint at `path` (its meta's `data`: `recorded_data`) against the
    sources of `cfg` as they are now, fingerprinted only when the checkpoint recorded theirs."""
    recorded = recorded_data.get("fingerprints")
    return edited(recorded, source_fingerprints(cfg)) if recorded else []


def changes(recorded: dict, cfg) -> list[str]:
    """`KEY=NOW (checkpoint: SAVED)` for each stream key that differs from the recorded ones. A key
    the checkpoint did not record (one added to STREAM_KEYS since) was at its default then."""
    now = stream_keys(cfg.to_dict())
    recorded = {**stream_keys(config_lib.defaults().to_dict()), **recorded}
    return [f"{k}={now.get(k)!r} (checkpoint: {recorded.get(k)!r})" for k in sorted(set(now) | set(recorded))
            if now.get(k) != recorded.get(k)]


def check(recorded: dict, cfg, path: str, recorded_encoding: dict | None = None, files: list[str] = ()) -> None:
    """ConfigError when the stream keys `recorded` by the checkpoint at `path` differ from `cfg`'s,
    or its sources' files did (`files`: `edited`'s lines), and `data.resume_position` is "same";
    or when seq_len differs with the position encoding `recorded_encoding` (its `encoding`; None:
    not known, not checked) unchanged."""
    differ = changes(recorded, cfg) + list(files)
    now = encoding(cfg.to_dict())
    if recorded_encoding is not None and recorded.get("seq_len") != cfg.seq_len and recorded_encoding == now:
        rope = ", ".join(f"{k}={v!r}" for k, v in now.items() if k in ("model.rope_theta", "model.rope_scaling"))
        raise ConfigError(
            f"seq_len={cfg.seq_len} but the checkpoint {path} was trained at seq_len={recorded.get('seq_len')}, "
            f"with the same position encoding ({rope}): a resume changes seq_len only to extend the context, "
            "with a new model.rope_scaling or model.rope_theta and data.resume_position=tokens or start "
            "(docs/checkpoints.md#extending-the-context); else resume with the checkpoint's seq_len")
    if differ and cfg.data.resume_position == "same":
        raise ConfigError(
            f"the checkpoint {path} read its data with other settings: {', '.join(differ)}; resuming would read "
            "other rows at the same data position. Resume with the checkpoint's settings, or choose "
            "data.resume_position=tokens (continue after the tokens already read: a batch ramp-up or a context "
            "extension) or data.resume_position=start (the new data from its beginning)")


def continued(meta: dict, cfg, dataset, path: str) -> int | None:
    """The data position the restored step reads under `data.resume_position` when the stream
    keys changed since the checkpoint (`meta`: its meta), else None (nothing changed, or a
    checkpoint that recorded nothing)."""
    recorded = meta.get("data")
    if not recorded:
        return None
    files = edited(recorded.get("fingerprints"), dataset.source_fingerprints)
    check(recorded["keys"], cfg, path, recorded.get("encoding"), files)
    differ = changes(recorded["keys"], cfg) + files
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
