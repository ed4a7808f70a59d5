"""Every signature the README and docs/ state is the code's signature: names, kinds and defaults.

What counts as a stated signature (the convention the pages follow):

* a **signature line**: a line that is one code span holding ``name(parameters)``, optionally ``-> result``, e.g.
  ```packfwd.micro.plan_micro_batches(seqlens, *, max_tokens, dp_size=1, ...) -> MicroBatchPlan```;
* a code span ``name(parameters)`` in the first column of an **API table** (a table whose first header cell is
  ``function``); a bare name there resolves in the module named earlier in the same cell, else in ``packfwd``;
* a **parameter table**: a table whose first header cell is ```name` parameter`` and second ``default``; one row
  per parameter, ```param``` then ```default``` or ``required``.  It must list every parameter.

A signature that lists ``...`` among its parameters is partial: the parameters it names must exist, in that
order, with those kinds and defaults.  Without ``...`` it must be complete.  A name resolves as a dotted path from
``packfwd`` (``packfwd.models.from_hf``), a bare name of ``packfwd.__all__``, or ``forward``: the function
``make_forward`` returns.  A name that does not resolve fails the test (qualify it), so no statement is skipped.
Each failure names the page, the line and what differs.  :func:`test_the_checker_catches_a_wrong_default` is the
negative control: a wrong default, a missing parameter and a wrong kind are each reported.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_SIG = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\((?P<params>.*)\)\s*(->.*)?$", re.S)
_CODE = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^(```|~~~)")


@dataclass(frozen=True)
class Stated:
    """One documented signature: where it is, the callable's name, and its parameters as written."""

    where: str
    name: str
    base: str  # the module a bare name resolves in
    params: list  # [(name, kind, default text or None)], kinds as inspect's names
    partial: bool
    problem: str | None = None  # why the parameters could not be read as Python


def _statement(where: str, name: str, base: str, params_text: str) -> Stated:
    try:
        params, partial = _parse_params(params_text)
    except SyntaxError:
        return Stated(where, name, base, [], False, f"({params_text}) is not a Python parameter list")
    return Stated(where, name, base, params, partial)


def _parse_params(text: str) -> tuple[list, bool]:
    """``'x, *, tp_size=1, ...'`` -> ([(name, kind, default source)], partial)."""
    items = [p.strip() for p in _split_top(text)]
    partial = "..." in items
    kept = [p for p in items if p and p != "..."]
    if kept and kept[-1] == "*":  # "x, *, ..." : keyword-only parameters exist, none named here
        kept.pop()
    source = ", ".join(kept)
    fn = ast.parse(f"def _f({source}): pass").body[0]
    a = fn.args
    out = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, None if d is None else ast.unparse(d)))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out, partial


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets and quotes."""
    parts, depth, cur, quote = [], 0, "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [*parts, cur]


def _signature_span(span: str):
    m = _SIG.match(span.strip())
    return (m.group("name"), m.group("params")) if m else None


def stated_signatures(text: str, page: str) -> list[Stated]:
    """Every signature ``text`` states, by the convention of the module docstring."""
    found, lines, in_fence, i = [], text.splitlines(), False, 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            i += 1
            continue
        if in_fence:
            i += 1
            continue
        where = f"{page}:{i + 1}"
        whole = re.fullmatch(r"\s*`([^`]+)`\s*", line)
        if whole and (sig := _signature_span(whole.group(1))):
            found.append(_statement(where, sig[0], "packfwd", sig[1]))
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|\s*$", lines[i + 1]):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            j = i + 2
            rows = []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j, _cells(lines[j])))
                j += 1
            if header[0] == "function":
                found += _api_rows(rows, page)
            elif m := re.fullmatch(r"`([\w.]+)` parameter", header[0]):
                assert header[1] == "default", f"{where}: a parameter table's second column must be 'default'"
                params = []
                for _, cells in rows:
                    pname = cells[0].strip().strip("`")
                    default = cells[1].strip()
                    kind = "VAR_KEYWORD" if pname.startswith("**") else "VAR_POSITIONAL" if pname.startswith("*") else None
                    params.append((pname.lstrip("*"), kind, None if default in ("required", "") else default.strip("`")))
                found.append(Stated(where, m.group(1), "packfwd", params, partial=False))
            i = j
            continue
        i += 1
    return found


def _cells(line: str) -> list[str]:
    """A table row's cells (a ``|`` inside a code span does not split)."""
    cells, cur, code = [], "", False
    for ch in line.strip()[1:-1]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cur)
            cur = ""
            continue
        cur += ch
    return [*cells, cur]


def _api_rows(rows, page) -> list[Stated]:
    out = []
    for j, cells in rows:
        base = "packfwd"
        for span in _CODE.findall(cells[0]):
            name = re.match(r"[A-Za-z_][\w.]*", span).group(0)
            if name.startswith("packfwd."):
                base = name.rsplit(".", 1)[0]
            sig = _signature_span(span)
            if sig:
                out.append(_statement(f"{page}:{j + 1}", sig[0], base, sig[1]))
    return out


def resolve(name: str, base: str = "packfwd"):
    """The object a documented name means (see the module docstring), or raise LookupError."""
    import packfwd

    if name == "forward":
        return packfwd.make_forward("thd")
    if name.startswith("packfwd."):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
            if obj is not None:
                return obj
        raise LookupError(name)
    module = importlib.import_module(base)
    if hasattr(module, name) and (base != "packfwd" or name in packfwd.__all__):
        return getattr(module, name)
    raise LookupError(f"{name} (in {base})")


def _default_matches(text: str, real) -> bool:
    try:
        return ast.literal_eval(text) == real and type(ast.literal_eval(text)) is type(real)
    except (ValueError, SyntaxError):
        return text in (repr(real), str(real), getattr(real, "__name__", None))


def differences(stated: Stated) -> list[str]:
    """What the stated signature gets wrong against the code ([] when it is right)."""
    if stated.problem:
        return [f"{stated.where}: {stated.name}{stated.problem}; write it as a Python signature"]
    try:
        obj = resolve(stated.name, stated.base)
    except LookupError as e:
        return [f"{stated.where}: {stated.name} does not resolve ({e}); qualify it (packfwd.<module>.<name>)"]
    real = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    by_name = {p.name: p for p in real}
    head = f"{stated.where}: {stated.name}"
    errors = []
    names = [n for n, _, _ in stated.params]
    if not stated.partial and set(names) != set(by_name):
        missing, extra = [n for n in by_name if n not in names], [n for n in names if n not in by_name]
        errors.append(f"{head} documents {names}; the code has {list(by_name)} (missing {missing}, not in the code {extra})")
    order = [by_name[n] for n in names if n in by_name]
    if order != sorted(order, key=real.index):
        errors.append(f"{head}: the parameters are in another order than the code's {list(by_name)}")
    for pname, kind, default in stated.params:
        p = by_name.get(pname)
        if p is None:
            if stated.partial:
                errors.append(f"{head}: {pname} is not a parameter of the code")
            continue
        if kind is not None and kind != p.kind.name:
            errors.append(f"{head}: {pname} is documented {kind}, the code has {p.kind.name}")
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if default is None and p.default is not p.empty:
            errors.append(f"{head}: {pname} is documented without a default; the code's default is {p.default!r}")
        elif default is not None and p.default is p.empty:
            errors.append(f"{head}: {pname} is documented with default {default}; the code has none")
        elif default is not None and not _default_matches(default, p.default):
            errors.append(f"{head}: {pname} is documented with default {default}; the code's is {p.default!r}")
    return errors


def _all_stated() -> list[Stated]:
    return [s for page in PAGES for s in stated_signatures(page.read_text(), str(page.relative_to(ROOT)))]


def test_documented_signatures_are_the_codes():
    stated = _all_stated()
    assert len(stated) >= 40, f"only {len(stated)} signatures found: has the convention changed?"
    errors = [e for s in stated for e in differences(s)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", ["make_forward", "packfwd.micro.plan_micro_batches", "packfwd.micro.run_micro_batches"])
def test_the_main_entry_points_have_a_complete_statement(name):
    """The forward factory and the step are stated whole somewhere (a table or a line without ``...``)."""
    assert any(s.name == name and not s.partial for s in _all_stated()), f"no complete signature of {name} in the docs"


def test_the_checker_catches_a_wrong_default():
    """Negative control: a page with a wrong default, a missing parameter and a wrong kind."""
    page = "\n".join([
        "`pad(packed, info, fill_value=1)`",
        "",
        "| `plan_bshd` parameter | default | meaning |",
        "|---|---|---|",
        "| `attention_mask` | required | |",
        "| `tp_size` | `1` | |",
        "",
        "| function | shapes |",
        "|---|---|",
        "| `sp_pad(packed, *, tp_size, fill_value=0)` | |",
    ])
    stated = stated_signatures(page, "control.md")
    assert [s.name for s in stated] == ["pad", "plan_bshd", "sp_pad"]
    pad, bshd, sp = (differences(s) for s in stated)
    assert len(pad) == 1 and "fill_value is documented with default 1" in pad[0]
    assert len(bshd) == 1 and "missing ['seqlens', 'x']" in bshd[0]
    assert len(sp) == 2 and "tp_size is documented KEYWORD_ONLY" in sp[0] and "fill_value" in sp[1]
