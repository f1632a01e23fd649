"""What the README, docs/ and the code's docstrings and comments cite exists: every repository
path (`maxlm/...`, `tests/...`, `launch/...`, `configs/...`, `docs/...`), every markdown link to
a page or a heading (`page.md#anchor`, `#anchor`) and every dotted `maxlm.` name. A file moved or
a heading renamed then fails here instead of leaving the reader a dead reference."""

import functools
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = sorted((ROOT / "maxlm").rglob("*.py"))

PATH = re.compile(r"(?<![\w/.-])((?:maxlm|tests|launch|configs|docs)/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_ANCHOR = re.compile(r"(?<![\w/.-])docs/([\w-]+\.md)#([\w-]+)")
DOTTED = re.compile(r"(?<![\w./-])(maxlm(?:\.\w+)+)")


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lowercase, punctuation dropped, spaces → hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(page: pathlib.Path) -> frozenset[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchor = heading_anchor(m.group(1))
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            found.add(anchor if n == 0 else f"{anchor}-{n}")
    return frozenset(found)


def cited_paths(text: str):
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if "*" in path or "{" in path or path.endswith(("/NAME", "/NAME.py")):
            continue  # a pattern (configs/NAME.py), not one file
        yield path


def path_exists(path: str) -> bool:
    target = ROOT / path.split("#")[0]
    return target.exists() or target.with_suffix("").exists()


SHORT_PATH = re.compile(r"`((?![\w/]*NAME)[\w/]*\w\.py)`")  # `step.py`, `train/step.py`: a module named by its file


@functools.cache
def repo_files() -> frozenset[str]:
    return frozenset(str(p.relative_to(ROOT)) for d in ("maxlm", "tests", "launch", "configs")
                     for p in (ROOT / d).rglob("*.py"))


def short_path_exists(path: str) -> bool:
    return any(f == path or f.endswith("/" + path) for f in repo_files())


def rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("source", [rel(p) for p in PAGES + CODE])
def test_cited_paths_exist(source):
    text = (ROOT / source).read_text()
    assert [p for p in cited_paths(text) if not path_exists(p)] == []


@pytest.mark.parametrize("source", [rel(p) for p in PAGES + CODE])
def test_modules_named_by_their_file_exist(source):
    text = (ROOT / source).read_text()
    assert [p for p in SHORT_PATH.findall(text) if not short_path_exists(p)] == []


@pytest.mark.parametrize("page", [rel(p) for p in PAGES])
def test_markdown_links_and_anchors_exist(page):
    path = ROOT / page
    dead = []
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            dead.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            dead.append(target)
    assert dead == []


@pytest.mark.parametrize("source", [rel(p) for p in CODE])
def test_docs_anchors_cited_in_code_exist(source):
    text = (ROOT / source).read_text()
    dead = [f"docs/{page}#{anchor}" for page, anchor in DOC_ANCHOR.findall(text)
            if not (ROOT / "docs" / page).exists() or anchor not in anchors(ROOT / "docs" / page)]
    assert dead == []


def resolves(dotted: str) -> bool:
    """Whether `maxlm.a.b.c` names a module, or an attribute reached from the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_dotted_maxlm_names_exist():
    dead = set()
    for path in PAGES + CODE:
        for name in DOTTED.findall(path.read_text()):
            if name.endswith((".py", ".md")) or not resolves(name):
                dead.add(f"{rel(path)}: {name}")
    assert sorted(dead) == []


def test_the_checks_find_dead_citations(tmp_path):
    assert not path_exists("maxlm/targets/gpu.py") and path_exists("maxlm/bench/targets/gpu.py")
    assert not short_path_exists("model/pipeline.py") and short_path_exists("parallel/pipeline.py")
    assert not resolves("maxlm.train.recover") and resolves("maxlm.train.loop.train_and_evaluate")
    page = tmp_path / "p.md"
    page.write_text("# The guides' ranges, watched\n## gs:// workdirs\n## Resume\n## Resume\n")
    assert anchors(page) == {"the-guides-ranges-watched", "gs-workdirs", "resume", "resume-1"}
