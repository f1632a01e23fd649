"""`python -m maxlm.data {tokenizer,prepare,stats,peek} --config=configs/NAME.py [--config.KEY=V]`.

  tokenizer --out=PATH.model|PATH.json [--special_tokens=A,B,...]
                              trains a tokenizer on a sample of the train split (vocab:
                              data.tokenizer_vocab_size, 0 = model.vocab_size): .model, a
                              byte-fallback BPE sentencepiece model (pieces pad=0, unk=1, bos=2,
                              eos=3); .json, a byte-level BPE (BBPE) tokenizer.json (pad=0, bos=1,
                              eos=2); the special tokens follow (data.pad_token, ... rename those)
  prepare [--runner=local] [--workers=N] | --runner=beam [-- BEAM_OPTIONS]
                              builds the packed caches (train, and validation unless eval is off)
                              with N processes (default data.workers; 0 = one per core), or as
                              Apache Beam pipelines (`pip install -e .[beam]`) with the options
                              after `--` (e.g. --runner=DataflowRunner ..., or DirectRunner's
                              --direct_num_workers=N --direct_running_mode=multi_processing)
  stats [--split=train]       prints one JSON object: documents, tokens, sequences,
                              packing_efficiency, skipped and filtered counts
  peek --step=N [--split=train] [--rows=K]
                              prints the decoded rows of global batch N; each segment starts
                              with a `⟦seg I⟧` marker, or `⟦seg 1 continued⟧` where the row
                              begins inside a document that began in the packed row before it

Bad data or config: one line on stderr, exit status 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence

from maxlm import cli

log = logging.getLogger("maxlm.data")

COMMANDS = ("tokenizer", "prepare", "stats", "peek")
# A byte-level BPE's first three special tokens: Llama 3's bos and eos, and a pad of bpe.PAD_NAMES
BBPE_SPECIALS = {"pad": "<|pad|>", "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"}


def data_error(message: str):
    print(f"maxlm: data error: {message}", file=sys.stderr)
    sys.exit(2)


def train_tokenizer(cfg, out: str, special_tokens: Sequence[str] = ()) -> dict:
    """Trains a tokenizer to `out` (atomically) on a seeded sample of `data.tokenizer_sample_docs`
    train documents and returns a summary: a sentencepiece model for `PATH.model`, a byte-level BPE
    tokenizer.json for `PATH.json`. Its pad, bos and eos come first (the names of `data.pad_token`,
    ..., else the defaults), then `special_tokens`."""
    import numpy as np

    from maxlm.data.prepare import filters
    from maxlm.runtime import progress

    out = os.path.abspath(os.path.expanduser(out))
    if not out.endswith((".model", ".json")):
        raise ValueError(f"--out must end in .model (sentencepiece) or .json (byte-level BPE), got {out!r}")
    counts = __import__("collections").Counter()
    with progress.Progress("tokenizer: read the train split", None) as line, \
            progress.polling(line, lambda: {"documents": counts["split_documents"]}):
        texts = filters.read_clean_documents(cfg.data, "train", counts)
    n = min(len(texts), cfg.data.tokenizer_sample_docs)
    pick = np.sort(np.random.default_rng(cfg.seed).choice(len(texts), n, replace=False))
    vocab = cfg.data.tokenizer_vocab_size or cfg.model.vocab_size
    sp = out.endswith(".model")
    default = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"} if sp else BBPE_SPECIALS
    names = {kind: cfg.data[f"{kind}_token"] or name for kind, name in default.items()}
    specials = [*dict.fromkeys(names.values()), *special_tokens]  # a BBPE's bos may be its eos (GPT-2's)
    if len(set(specials)) != len(specials) or (sp and len(set(names.values())) < 3):
        raise ValueError(f"the special tokens {[*names.values(), *special_tokens]} (pad, bos, eos, then "
                         "--special_tokens) name a token twice")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    kind = "sentencepiece BPE" if sp else "byte-level BPE"
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp, \
            progress.Progress(f"tokenizer: train a {kind}", None) as line, progress.polling(line):
        line.update(documents=int(n))  # its own loop shows nothing: a heartbeat says it is alive
        if sp:
            _train_sentencepiece([texts[i] for i in pick], vocab, names, list(special_tokens), tmp, out)
        else:
            _train_bbpe([texts[i] for i in pick], vocab, specials, tmp, out)
    from maxlm.data.tokenizers import load_tokenizer

    tok = load_tokenizer(out, **{f"{kind}_token": name for kind, name in names.items()})
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"trained vocab_size={tok.vocab_size} > model.vocab_size={cfg.model.vocab_size}")
    common = {"vocab_size": tok.vocab_size, "requested_vocab_size": vocab, "sample_documents": int(n),
              "pad_id": tok.pad_id}
    if sp:
        return {"model": out, **common, "unk_id": 1, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                "byte_fallback": True, "model_type": "bpe", **({"special_tokens": specials} if special_tokens else {})}
    return {"tokenizer": out, **common, "bos_id": tok.bos_id, "eos_id": tok.eos_id, "model_type": "byte_level_bpe",
            "special_tokens": specials}


def _train_sentencepiece(texts: list[str], vocab: int, names: dict, control: list[str], tmp: str, out: str) -> None:
    import sentencepiece as spm

    sample = os.path.join(tmp, "sample.txt")
    with open(sample, "w", encoding="utf-8") as f:
        for text in texts:  # sentencepiece reads lines; empty lines carry nothing
            f.write(text if text.endswith("\n") else text + "\n")
    try:
        spm.SentencePieceTrainer.train(
            input=sample, model_prefix=os.path.join(tmp, "tok"), vocab_size=vocab,
            model_type="bpe", byte_fallback=True, character_coverage=0.9995,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            pad_piece=names["pad"], unk_piece="<unk>", bos_piece=names["bos"], eos_piece=names["eos"],
            control_symbols=control,  # special: never produced from text
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True,
            max_sentence_length=1 << 16, input_sentence_size=2_000_000,
            shuffle_input_sentence=True, seed_sentencepiece_size=1_000_000,
            hard_vocab_limit=False, num_threads=os.cpu_count() or 1, minloglevel=2,
        )  # fmt: skip
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed: {str(e).splitlines()[0]}") from None
    os.replace(os.path.join(tmp, "tok.model"), out)


def _train_bbpe(texts: list[str], vocab: int, specials: list[str], tmp: str, out: str) -> None:
    """Byte-level BPE as Llama 3's and GPT-2's: Llama 3's pre-tokenizer regex, then merges over the
    256 bytes (every text encodes, with no unknown token); `specials` take the first ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from maxlm.data.tokenizers.bpe import LLAMA3_PATTERN

    if vocab < 256 + len(specials):
        raise ValueError(f"a byte-level BPE needs a vocabulary of at least 256 bytes + {len(specials)} special "
                         f"tokens; data.tokenizer_vocab_size (or model.vocab_size) is {vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.save(os.path.join(tmp, "tokenizer.json"))
    os.replace(os.path.join(tmp, "tokenizer.json"), out)


def prepare(cfg, workers: int | None, beam_args: tuple[str, ...] | None = None) -> dict:
    """Builds the caches (a local process pool, or Beam pipelines with `beam_args`); per split:
    its directory, shards, rows and the seconds it took."""
    import time

    from maxlm.data import sources
    from maxlm.data.prepare import build

    if workers is not None and workers < 0:
        cli.config_error(f"--workers must be >= 0 (0 = one per core), got {workers}")
    if cfg.data.mixture:
        return {name: prepare(sub, workers, beam_args) for name, _, sub in sources.resolve(cfg)}
    result = ({"runner": "beam", "beam_options": list(beam_args)} if beam_args is not None else
              {"runner": "local", "workers": workers if workers is not None else cfg.data.workers})
    for split in ["train"] + (["validation"] if cfg.eval.every_steps else []):
        start = time.perf_counter()
        rows, info = build.prepare(cfg, split, workers=workers, beam_args=beam_args)
        result[split] = {"cache": str(build.cache_path(cfg, split)[0]), "shards": len(info["shards"]),
                         "rows": rows.num_rows, "tokens": info["tokens"],
                         "seconds": round(time.perf_counter() - start, 3)}
    return result


def stats(cfg, split: str) -> dict:
    """The split's statistics; with `data.mixture`, those of each source under its name."""
    from maxlm.data import sources
    from maxlm.data.prepare import build

    if cfg.data.mixture:
        return {name: stats(sub, split) for name, _, sub in sources.resolve(cfg)}
    _, info = build.prepare(cfg, split)
    keys = ("source", "split", "tokenizer", "vocab_size", "seq_len", "files", "documents", "tokens",
            "sequences", "packing_efficiency", "long_documents", "skipped", "filtered")
    return {k: info.get(k) for k in keys}


CONTINUED = "continued"


def peek(cfg, step: int, split: str, max_rows: int) -> str:
    """Global batch `step` of `split` decoded, at most `max_rows` rows: a header line naming the
    rows, then per row its segments, each after a `⟦seg I⟧` marker, `⟦seg 1 continued⟧` for a
    row's first segment that continues a document from the packed row before it, and a
    `⟦pad ×N⟧` marker for its padding."""
    import numpy as np

    from maxlm.data import make_dataset

    ds = make_dataset(cfg, split)
    b = ds.batch(step)
    if cfg.data.mixture:  # each row's source, and its row in that source's order
        source, sample = ds.slot_sources(np.arange(ds.batch_size) + step * ds.batch_size)
        where = [f"{ds.names[i]}#{int(k)}" for i, k in zip(source, sample)][:max_rows]
        out = [f"# step {step} of {split}, rows {where}"]
    else:
        out = [f"# step {step} of {split} (epoch {ds.epoch_of(step)}), rows {ds.row_ids(step).tolist()[:max_rows]}"]
    for r in range(min(max_rows, b["inputs"].shape[0])):
        seg, inputs = b["segment_ids"][r], b["inputs"][r]
        out.append(f"=== row {r}: {int(seg.max())} segments, {int(np.count_nonzero(seg))} tokens ===")
        parts = []
        for s in range(1, int(seg.max()) + 1):
            cols = np.flatnonzero(seg == s)
            # Positions restart at 0 in every segment (maxlm/data/packing.py), so they cannot tell
            # a continuation; a document's first input is bos, and a continuing segment's is not.
            continued = f" {CONTINUED}" if int(inputs[cols[0]]) != ds.tokenizer.bos_id else ""
            parts.append(f"⟦seg {s}{continued}⟧" + ds.tokenizer.decode(inputs[cols]))
        if (seg == 0).any():
            parts.append(f"⟦pad ×{int((seg == 0).sum())}⟧")
        out.append("".join(parts))
    return "\n".join(out)


def main(argv) -> None:
    import jax
    from absl import flags

    if len(argv) < 2 or argv[1] not in COMMANDS or (len(argv) > 2 and argv[1] != "prepare"):
        cli.config_error(f"usage: python -m maxlm.data {{{','.join(COMMANDS)}}} --config=...; got {argv[1:]}")
    cli.setup_logging()
    cfg = cli.resolved_config(jax.device_count())
    F = flags.FLAGS
    try:
        if argv[1] == "tokenizer":
            if not F.out:
                cli.config_error("tokenizer needs --out=PATH.model (sentencepiece) or --out=PATH.json (byte-level BPE)")
            print(json.dumps(train_tokenizer(cfg, F.out, F.special_tokens or ()), indent=2))
        elif argv[1] == "prepare":
            if F.runner == "local" and len(argv) > 2:
                cli.config_error(f"options after -- are Beam's (--runner=beam); got {argv[2:]}")
            beam_args = tuple(argv[2:]) if F.runner == "beam" else None
            if beam_args is not None:
                try:
                    import apache_beam  # noqa: F401
                except ImportError:
                    cli.config_error("--runner=beam needs Apache Beam: pip install -e .[beam]")
            print(json.dumps(prepare(cfg, F.workers, beam_args), indent=2))
        elif argv[1] == "stats":
            print(json.dumps(stats(cfg, F.split), indent=2))
        else:
            if F.step is None or F.step < 0:
                cli.config_error("peek needs --step=N (N >= 0)")
            print(peek(cfg, F.step, F.split, F.rows))
    except ValueError as e:  # DataError included: bad data, named by file and line
        data_error(str(e))


def _define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("out", None, "tokenizer: where to write it: PATH.model (sentencepiece) or PATH.json "
                        "(a byte-level BPE tokenizer.json).")
    flags.DEFINE_list("special_tokens", [], "tokenizer: special tokens after pad, bos and eos (comma-separated).")
    flags.DEFINE_enum("split", "train", ["train", "validation"], "stats/peek: which split.")
    flags.DEFINE_integer("step", None, "peek: the global batch to show.")
    flags.DEFINE_integer("rows", 1 << 30, "peek: at most this many rows.")
    flags.DEFINE_enum("runner", "local", ["local", "beam"], "prepare: where it runs (local: a process pool; "
                      "beam: Apache Beam pipelines with the options after --).")
    flags.DEFINE_integer("workers", None, "prepare: processes (default data.workers; 0 = one per core).")


if __name__ == "__main__":
    cli.run(main, _define_flags)
