"""The data package's entry point: `make_dataset(config, split)`, training and eval batches as a
pure function of (config, step).

It goes down through the package once, a module per step:
  1. `sources.resolve`: the config's source(s), `data.source` or the `data.mixture` entries;
  2. `tokenizer.checked_tokenizer`: `data.tokenizer`, checked against the model's vocabulary;
  3. `build.prepare`: each source's split read, cleaned, tokenized and packed (`packing`) once
     into a cache entry of ArrayRecord shards (`shards`), or the entry found;
  4. `batches.TokenDataset` (one source) or `mixture.MixtureDataset` (several, by weight): which
     rows form the batch of each step, read from the shards on demand.
"""

from __future__ import annotations

from maxlm.data import sources
from maxlm.data.batches import TokenDataset
from maxlm.data.mixture import MixtureDataset
from maxlm.data.prepare import build
from maxlm.data.tokenizers import checked_tokenizer

# The config keys the rows of a step's batch depend on (besides the step): a resume in which one of
# them changed would read other rows at the same data position (see `data.resume_position`).
STREAM_KEYS = ("seed", "batch_size", "seq_len", "data.source", "data.mixture", "data.tokenizer", "data.bos_token",
               "data.eos_token", "data.pad_token", "data.tokenizer_pattern", "data.tokenizer_special_tokens", "data.text_key",
               "data.txt_documents", "data.validation_percent", "data.bad_records", "data.shard_mb",
               "data.shard_examples", "data.filters")


def make_dataset(config, split: str) -> TokenDataset | MixtureDataset:
    """The packed `split` ("train" or "validation") of `config.data.source`, or of the sources
    of `config.data.mixture` drawn by weight.

    Reads `seed, batch_size, seq_len, model.vocab_size` and `data.*`. Prepares the packed cache
    on first use. Raises `DataError` (a ValueError) on bad data, naming file and line.
    """
    resolved = sources.resolve(config)
    tokenizer = checked_tokenizer(config)
    packed = [build.prepare(sub, split, tokenizer) for _, _, sub in resolved]  # (rows, meta) each
    seed = config.seed if split == "train" else None
    if not config.data.mixture:
        [(rows, meta)] = packed
        dataset = TokenDataset(rows, tokenizer=tokenizer, batch_size=config.batch_size, seed=seed, split=split,
                               packing_efficiency=meta["packing_efficiency"])
    else:
        names = [name for name, _, _ in resolved]
        dataset = MixtureDataset([(name, rows) for name, (rows, _) in zip(names, packed)],
                                 [weight for _, weight, _ in resolved], tokenizer=tokenizer,
                                 batch_size=config.batch_size, seq_len=config.seq_len, seed=seed, split=split,
                                 stats={name: meta for name, (_, meta) in zip(names, packed)})
    # what the checkpoints record of the content read, taken once (a save does not list the files)
    dataset.source_fingerprints = source_fingerprints(config)
    return dataset


def source_fingerprints(config) -> dict[str, str]:
    """{source name: fingerprint} of each source the run reads (`sources.resolve`'s names): the
    fingerprint the packed cache's key holds (`sources.source_fingerprint`: the files' names,
    sizes and modification times, or a TFDS dataset's info), so that a resume can tell that files
    were added, removed or edited since a checkpoint. Reads no document."""
    return {name: sources.source_fingerprint(sources.parse_source(sub.data.source), sub.data)
            for name, _, sub in sources.resolve(config)}
