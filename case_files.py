"""The competition's case files: `m: [..]; n: [..]; k: [..]; g: G; seed: S`, one case a line.

Read by eval.py (every mode) and selfcheck.py (the shipped tests and benchmarks); a module of
its own so that neither imports the other for it (eval.py dispatches to selfcheck.py, one way).
Every line is checked before anything runs: the keys m, n, k, g, seed each once, integers, m/n/k
lists of g sizes, 1 <= g <= 64, M >= 1, N >= 1, K a positive multiple of 256, 0 <= seed < 2**64;
blank lines and `#` comments are allowed; an empty file is invalid. `get_test_cases` is the
competition's entry point (an invalid file: one line on stderr, exit 113).
"""

import dataclasses
import re
import sys
from pathlib import Path


@dataclasses.dataclass
class TestCase:
    args: dict
    spec: str
    line: int = 0  # its line in the case file (0: not from a file)


def _combine(a: int, b: int) -> int:
    # Cantor pairing: a large secret seed gives a large combined seed whatever the
    # (public, small) test-level seed is.
    return int(a + (a + b) * (a + b + 1) // 2)


CASE_KEYS = ("m", "n", "k", "g", "seed")
MAX_GROUPS = 64
# torch.manual_seed (which generate_input calls with a case's seed) takes seeds below 2**64.
CASE_SEED_LIMIT = 2**64
K_MULTIPLE = 256
CASE_FORMAT = "m: [M, ...]; n: [N, ...]; k: [K, ...]; g: G; seed: S"
# key: value where value is a list [1, 2], a tuple (1, 2), an integer or a word (the
# competition's syntax; words and non-integer lists are then rejected by the rules below).
_PART = re.compile(r"\s*([a-zA-Z_]+)\s*:\s*(\[[^\]]*\]|\([^)]*\)|[a-zA-Z_]+|[+-]?[0-9]+)\s*")
_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")


class CaseError(ValueError):
    """One problem in one case line; the message names the rule."""


def _parse_sizes(key: str, text: str, g: int) -> tuple[int, ...]:
    inner = text[1:-1] if text[:1] in "[(" and text[-1:] in "])" else None
    items = inner.split(",") if inner is not None and inner.strip() else []
    if inner is None or not all(_INTEGER.fullmatch(item) for item in items):
        raise CaseError(f"{key} = {text!r}; rule: {key} is a list [..] of g integers")
    values = tuple(int(item) for item in items)
    if len(values) != g:
        raise CaseError(f"{key} has {len(values)} value{'s' * (len(values) != 1)} but g = {g};"
                        f" rule: m, n and k each list exactly g sizes")
    rule = {
        "m": "M >= 1 (as in every official case; the kernels accept M = 0, case files do not)",
        "n": "N >= 1",
        "k": f"K is a positive multiple of {K_MULTIPLE}",
    }[key]
    for index, value in enumerate(values):
        if value < 1 or (key == "k" and value % K_MULTIPLE):
            raise CaseError(f"{key}[{index}] = {value}; rule: {rule}")
    return values


def parse_case(text: str) -> dict:
    """One case line (comment removed) -> {m, n, k, g, seed}; raises CaseError."""
    parts = {}
    for part in text.split(";"):
        matched = _PART.fullmatch(part)
        if not matched:
            raise CaseError(f"{part.strip()!r} is not `key: value`; rule: a case is "
                            f"`{CASE_FORMAT}`")
        key, value = matched[1], matched[2]
        if key not in CASE_KEYS:
            raise CaseError(f"unknown key {key!r}; rule: the keys are m, n, k, g, seed")
        if key in parts:
            raise CaseError(f"{key!r} given twice; rule: each key once")
        parts[key] = value
    missing = [key for key in CASE_KEYS if key not in parts]
    if missing:
        raise CaseError(f"missing {', '.join(map(repr, missing))}; rule: a case is "
                        f"`{CASE_FORMAT}`")
    if not _INTEGER.fullmatch(parts["g"]) or not 1 <= int(parts["g"]) <= MAX_GROUPS:
        raise CaseError(f"g = {parts['g']!r}; rule: g is an integer, 1 <= g <= {MAX_GROUPS}")
    g = int(parts["g"])
    if not _INTEGER.fullmatch(parts["seed"]) or int(parts["seed"]) < 0:
        raise CaseError(f"seed = {parts['seed']!r}; rule: seed is an integer >= 0")
    if int(parts["seed"]) >= CASE_SEED_LIMIT:
        raise CaseError(f"seed = {parts['seed']!r}; rule: seed < 2**64 (the range of "
                        "torch.manual_seed, which seeds the input generator)")
    case = {key: _parse_sizes(key, parts[key], g) for key in ("m", "n", "k")}
    case.update(g=g, seed=int(parts["seed"]))
    return case


def read_test_cases(file_name: str) -> list[TestCase]:
    """Every case of a case file, checked completely; raises CaseError naming the line."""
    content = Path(file_name).read_text()
    tests = []
    for line_number, line in enumerate(content.splitlines(), start=1):
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue  # blank line or comment
        try:
            tests.append(TestCase(spec=spec, args=parse_case(spec), line=line_number))
        except CaseError as error:
            raise CaseError(f"{file_name}:{line_number}: {error}") from None
    if not tests:
        raise CaseError(f"{file_name}: no test case (only blank lines or comments); "
                        "rule: at least one case line")
    return tests


def get_test_cases(file_name: str, seed: int | None) -> list[TestCase]:
    """The competition's entry point: the cases of `file_name`, seeds combined with `seed`.

    An unreadable or invalid file prints one line to stderr and exits with 113."""
    try:
        tests = read_test_cases(file_name)
    except CaseError as error:
        print(f"invalid test case file {error}", file=sys.stderr)
        sys.exit(113)
    except Exception as E:  # noqa: BLE001 - the competition reports any read error as 113
        print(f"Could not open test file `{file_name}`: {E}", file=sys.stderr)
        sys.exit(113)

    if seed is not None:
        for test in tests:
            combined = _combine(test.args["seed"], seed)
            if combined >= CASE_SEED_LIMIT:
                print(f"invalid test case file {file_name}:{test.line}: seed = "
                      f"{test.args['seed']} combined with POPCORN_SEED = {seed} is {combined}; "
                      "rule: the combined seed < 2**64 (the range of torch.manual_seed, which "
                      "seeds the input generator)", file=sys.stderr)
                sys.exit(113)
            test.args["seed"] = combined
    return tests
