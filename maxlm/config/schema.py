"""How config keys are declared: each one once, with its default, its domain (its type and the
values it may take) and its one-line description, from which `resolve` checks a config and
docs/config.md's key table is written (maxlm/config/reference.py).

    s = Section()
    s.lr = key(3e-4, POSITIVE, "peak learning rate, reached after the warmup")
    s.source = key("tfds:python_stdlib", doc="where the documents come from")

Also here: `Assigned`, the ConfigDict that `defaults()` returns, which records the keys a config
file or a `--config.KEY` flag assigns, so that a key the user set counts as set even when its
value equals the default.
"""

from __future__ import annotations

import dataclasses
import difflib

import ml_collections

from maxlm.config.rules import Domain

SAME = "same as the key before"  # a doc: this key is described with the one declared just before


@dataclasses.dataclass(frozen=True)
class Key:
    default: object
    domain: Domain | None
    doc: str
    shown: str | None = None  # the default as docs/config.md shows it, where its repr is unreadable

    @property
    def type(self) -> type:
        return self.domain.type if self.domain else type(self.default)


def key(default, domain: Domain | None = None, doc: str = "", shown: str | None = None) -> Key:
    """One key's declaration. A number or a bool needs a domain, and the default must be of the
    domain's type (a count is an int domain's: `POSITIVE_INT`, not `POSITIVE`); every key needs
    its description. Refused at import, so no key can be declared without them."""
    if not doc:
        raise TypeError(f"config key with default {default!r} needs its one-line doc")
    if domain is None and isinstance(default, (bool, int, float)):
        raise TypeError(f"config key {default!r} ({doc[:40]}...) needs a domain")
    if domain is not None and type(default) is not domain.type:
        raise TypeError(f"config key {default!r} ({doc[:40]}...) is a {type(default).__name__}, but its domain "
                        f"'{domain.what}' holds {domain.type.__name__}s")
    return Key(default, domain, doc, shown)


class Section:
    """One section of the declarations: `s.name = key(...)` or `s.name = Section()`, in order."""

    def __init__(self):
        object.__setattr__(self, "entries", {})  # name: Key or Section

    def __setattr__(self, name, value):
        if not isinstance(value, (Key, Section)):
            raise TypeError(f"config key {name} = {value!r}: declare it with key(default, DOMAIN, doc)")
        self.entries[name] = value

    def __getattr__(self, name):  # `c.debug.nan_steps = ...` declares a key of the nested section
        if name not in self.entries:
            raise AttributeError(name)
        return self.entries[name]

    def keys(self, prefix: str = "") -> dict[str, Key]:
        """{dotted name: Key} of every key, nested sections' included, in declaration order."""
        out = {}
        for name, value in self.entries.items():
            if isinstance(value, Section):
                out.update(value.keys(f"{prefix}{name}."))
            else:
                out[prefix + name] = value
        return out

    def values(self) -> dict:
        return {name: value.values() if isinstance(value, Section) else value.default
                for name, value in self.entries.items()}


class Assigned(ml_collections.ConfigDict):
    """A ConfigDict that records, in one set shared by its sections, the dotted keys assigned to
    it once `record()` has been called: what a config file and the `--config.KEY` flags set.
    A copy (`copy.deepcopy`, pickling, `copy_and_resolve_references`) records nothing: the record
    is what the user wrote, read once by `config.resolve`."""

    def __init__(self, initial_dictionary=None, type_safe=True, **kwargs):
        super().__init__(type_safe=type_safe, **kwargs)
        object.__setattr__(self, "_record", None)  # (the shared set, this section's dotted prefix)
        for name, value in (initial_dictionary or {}).items():
            self[name] = Assigned(value, type_safe=type_safe) if isinstance(value, dict) else value

    def record(self, assigned: set | None = None, prefix: str = "") -> set:
        assigned = set() if assigned is None else assigned
        object.__setattr__(self, "_record", (assigned, prefix))
        for name, value in self.items():
            if isinstance(value, Assigned):
                value.record(assigned, f"{prefix}{name}.")
        return assigned

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        record = self.__dict__.get("_record")
        if record is not None:
            assigned, prefix = record
            child = self[name]
            if isinstance(child, ml_collections.ConfigDict):  # a section assigned whole: its keys
                assigned.update(prefix + f"{name}.{k}" for k in flatten(child.to_dict()))
            else:
                assigned.add(prefix + name)

    def __reduce__(self):  # a plain ConfigDict of the same values: what a copy or a worker needs
        return ml_collections.ConfigDict, (self.to_dict(),)


def assigned_keys(config) -> frozenset[str] | None:
    """The dotted keys assigned to `config` since `defaults()` made it (a config file's and the
    flags'), or None where that is unknown (a config read back from a run's config.json)."""
    record = config.__dict__.get("_record") if isinstance(config, Assigned) else None
    return frozenset(record[0]) if record is not None else None


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{name}."))
        else:
            out[prefix + name] = value
    return out


def unknown_key_message(name: str, known) -> str:
    """`name` is no config key: the nearest known ones, within its section first."""
    section = name.rpartition(".")[0]
    mates = [k for k in known if k.rpartition(".")[0] == section]
    near = difflib.get_close_matches(name, mates, n=1, cutoff=0.6) or difflib.get_close_matches(name, known, n=1)
    return f"unknown config key {name}" + (f": did you mean {near[0]}?" if near else "")


def expected(k: Key) -> str:
    """What a key's values must be, in words: its domain's, else its type's."""
    return k.domain.what if k.domain else f"a {k.type.__name__}"
