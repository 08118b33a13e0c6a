"""Checks of the documentation's markup: emphasis that Markdown would misread, and math.

Formulas are TeX between `$...$` (inline) and `$$...$$` (display), which
pymdownx.arithmatex turns into `\\(...\\)` / `\\[...\\]` for KaTeX to render on the page
(and GitHub renders the same source). Two mistakes print a page wrong without any
warning from MkDocs, and these checks find them:

* An asterisk outside a formula that Markdown pairs with another into emphasis: the
  `*` of `θ*_j` or `w*` written as plain text vanishes and the words between two of them
  turn italic. `markdown_problems` reads a page's Markdown source (code, formulas and
  HTML comments left out) and accepts an asterisk only as a well-formed emphasis
  delimiter (`*word ...*`, `**word ...**`) that is closed in the same paragraph or table
  cell; a literal asterisk is written inside a formula (`$\\theta^*_j$`), in code or
  escaped (`\\*`).
* Math that did not become math: a `$`, `$$`, `\\(` or `\\[` delimiter, or a TeX command,
  left in the page's text; a formula that caught prose between two unrelated dollar
  signs (`$HOME and $PATH`); emphasis whose text starts or ends where no emphasis would
  (after an asterisk inside a formula). `html_problems` reads a built page.

docs/hooks.py runs both on every page, so `mkdocs build` fails on either;
tests/test_docs_math.py runs them on examples and on the README.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

# ----------------------------------------------------------------------------- Markdown

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_DISPLAY_MATH = re.compile(r"\$\$.+?\$\$", re.S)
# pymdownx.arithmatex's inline pattern with smart_dollar (its default).
# (Not across a blank line or into a table row: a formula stays in its paragraph or cell.)
_INLINE_MATH = re.compile(r"(?<!\\)\$(?!\s)(?:\\.|(?!\n\s*\n|\n\s*\|)[^\\$])+?(?<!\s)\$")
_LIST_MARKER = re.compile(r"^(\s*)(?:[*+-]|\d+\.)\s+")
_RULE = re.compile(r"^\s*(?:\*\s*){3,}$|^\s*(?:-\s*){3,}$")
# What may stand just before an opening delimiter and just after a closing one.
_BEFORE_OPEN = set(" \t([{\"'‘“—–-/")
_AFTER_CLOSE = set(" \t.,;:)]}!?\"'’”—–-/")


def _blank_out(text: str, pattern: re.Pattern, fill: str = " ") -> str:
    """`text` with every character of a match of `pattern` replaced by `fill` (newlines
    kept, so line numbers stay)."""
    return pattern.sub(lambda m: re.sub(r"[^\n]", fill, m.group(0)), text)


def _prose(markdown: str) -> str:
    """The Markdown with everything that is not prose blanked: fenced and indented code,
    HTML comments, code spans, formulas and escaped asterisks."""
    out, fence, in_code, in_list, previous_blank = [], None, False, False, True
    for line in markdown.split("\n"):
        match = _FENCE.match(line)
        if fence:
            if match and match.group(2)[0] == fence[0] and len(match.group(2)) >= len(fence):
                fence = None
            out.append("")
            continue
        if match:
            fence = match.group(2)
            out.append("")
            continue
        blank = not line.strip()
        indented = line.startswith(("    ", "\t"))
        if in_code:
            if blank or indented:
                out.append("")
                continue
            in_code = False
        if indented and previous_blank and not in_list:  # an indented code block
            in_code = True
            out.append("")
            continue
        if _LIST_MARKER.match(line) and not indented:
            in_list = True
        elif not blank and not line.startswith((" ", "\t")):
            in_list = False
        previous_blank = blank
        out.append(line)
    text = "\n".join(out)
    text = _blank_out(text, _COMMENT)
    # Code and formulas become a word ("x..."), so that an emphasis around them still
    # reads as one: **`name`** stays well formed.
    for pattern in (_DISPLAY_MATH, _CODE_SPAN, _INLINE_MATH):
        text = _blank_out(text, pattern, "x")
    return text.replace("\\*", "  ")


def _units(prose: str):
    """(line number, text) of each paragraph, or of each cell of a table row."""
    paragraph, start = [], 1
    for number, line in enumerate(prose.split("\n"), 1):
        if line.lstrip().startswith("|"):
            if paragraph:
                yield start, "\n".join(paragraph)
                paragraph = []
            for cell in re.split(r"(?<!\\)\|", line):
                yield number, cell
            continue
        if not line.strip() or _RULE.match(line):
            if paragraph:
                yield start, "\n".join(paragraph)
            paragraph = []
            continue
        if _LIST_MARKER.match(line):  # a list item starts a paragraph of its own
            if paragraph:
                yield start, "\n".join(paragraph)
                paragraph = []
            line = _LIST_MARKER.sub(lambda m: " " * len(m.group(0)), line, count=1)
        if not paragraph:
            start = number
        paragraph.append(line)
    if paragraph:
        yield start, "\n".join(paragraph)


def markdown_problems(markdown: str, name: str = "") -> list[str]:
    """Asterisks in `markdown`'s prose that are not a closed, well-formed emphasis."""
    problems = []
    where = f"{name}:" if name else "line "
    for start, unit in _units(_prose(markdown)):
        open_stack: list[tuple[str, int]] = []
        i = 0
        while i < len(unit):
            if unit[i] != "*":
                i += 1
                continue
            j = i
            while j < len(unit) and unit[j] == "*":
                j += 1
            run = unit[i:j]
            before = unit[i - 1] if i else " "
            after = unit[j] if j < len(unit) else " "
            line = start + unit.count("\n", 0, i)
            snippet = unit[max(0, i - 25):j + 25].replace("\n", " ").strip()
            can_open = (before in _BEFORE_OPEN or before == "\n") and not after.isspace()
            can_close = not before.isspace() and (after in _AFTER_CLOSE or after == "\n")
            if can_close and open_stack and open_stack[-1][0] == run:
                open_stack.pop()
            elif can_open:
                open_stack.append((run, line))
            elif can_close:
                problems.append(f"{where}{line}: {run!r} closes an emphasis that was never "
                                f"opened (a literal asterisk belongs in a $formula$, in code "
                                f"or escaped as \\*): ...{snippet}...")
            else:
                problems.append(f"{where}{line}: {run!r} inside a word is read as emphasis "
                                f"(write the formula as $...$ TeX, or escape it as \\*): "
                                f"...{snippet}...")
            i = j
        for run, line in open_stack:
            problems.append(f"{where}{line}: emphasis {run!r} opened and never closed in "
                            "its paragraph")
    return problems


# ----------------------------------------------------------------------------- HTML

_SKIP = {"code", "pre", "script", "style", "kbd", "samp"}
_VOID = {"br", "hr", "img", "input", "meta", "link", "wbr", "source", "area", "col", "base"}
# Commands whose braced argument is text, not math (and the environment names of
# \begin{...} and \end{...}).
_TEXT_COMMANDS = re.compile(
    r"\\(?:text\w*|math(?:rm|tt|sf|it|bf)|operatorname\*?|begin|end)\s*\{[^{}]*\}")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{4,}")
_TEX_COMMAND = re.compile(r"\\(?:[a-zA-Z]{2,}|[()\[\]])")
_DOLLAR_PAIR = re.compile(r"\$(?!\s)[^$\n]+?(?<!\s)\$")
_BAD_EMPHASIS_START = re.compile(r"^[\s_^,.;:)\]}‖|=]")
_BAD_EMPHASIS_END = re.compile(r"[\s(\[{_^=]$")


def _balanced(tex: str) -> bool:
    depth = 0
    for char in re.sub(r"\\[{}]", "", tex):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


class _Page(HTMLParser):
    """Collects the text outside code and math, the formulas and the emphasis."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.skip = 0
        self.math: list[list[str]] = []  # [tag, raw content] of the open math element
        self.formulas: list[tuple[str, str]] = []
        self.emphasis: list[list[str]] = []
        self.closed_emphasis: list[tuple[str, str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if self.math:
            self.math[-1][1] += f"<{tag}>"
            if tag not in _VOID:
                self.math[-1][2] += 1
            return
        if "arithmatex" in classes or tag in _SKIP:
            # Code or a formula inside an emphasis counts as a word of its text.
            for open_emphasis in self.emphasis:
                open_emphasis[1] += "x"
        if "arithmatex" in classes:
            self.math.append([tag, "", 0])
            return
        if tag in _VOID:
            return
        self.stack.append(tag)
        if tag in _SKIP:
            self.skip += 1
        if tag in ("em", "strong"):
            self.emphasis.append([tag, ""])

    def handle_endtag(self, tag):
        if self.math:
            if self.math[-1][2]:
                self.math[-1][2] -= 1
                self.math[-1][1] += f"</{tag}>"
                return
            _, content, _ = self.math.pop()
            self.formulas.append((tag, content))
            return
        if tag in _VOID or tag not in self.stack:
            return
        while self.stack:
            top = self.stack.pop()
            if top in _SKIP:
                self.skip -= 1
            if top in ("em", "strong") and self.emphasis:
                self.closed_emphasis.append(tuple(self.emphasis.pop()))
            if top == tag:
                break

    def handle_data(self, data):
        if self.math:
            self.math[-1][1] += data
            return
        if self.skip:
            return
        for open_emphasis in self.emphasis:
            open_emphasis[1] += data
        self.text.append(data)


def html_problems(html: str, name: str = "") -> list[str]:
    """Unrendered or misparsed math and misplaced emphasis in a built page."""
    page = _Page()
    page.feed(html)
    page.close()
    where = f"{name}: " if name else ""
    problems = []
    for tag, content in page.formulas:
        shown = " ".join(content.split())[:80]
        match = re.fullmatch(r"\s*\\\((.*)\\\)\s*|\s*\\\[(.*)\\\]\s*", content, re.S)
        if match is None:
            problems.append(f"{where}math element <{tag}> not wrapped in \\( \\) or \\[ \\]: "
                            f"{shown}")
            continue
        tex = match.group(1) if match.group(1) is not None else match.group(2)
        if "<" in tex and re.search(r"</?[a-z]+>", tex):
            problems.append(f"{where}markup inside a formula: {shown}")
        if not _balanced(tex):
            problems.append(f"{where}unbalanced braces in a formula: {shown}")
        words = _WORD.findall(_TEXT_COMMANDS.sub("", tex))
        if words:
            problems.append(f"{where}prose inside a formula ({', '.join(words[:3])}; two "
                            f"dollar signs that are not math?): {shown}")
    text = "\n".join(page.text)  # one text node a line: a pair of $ stays within one
    for pattern, what in ((re.compile(r"\$\$"), "a $$ display-math delimiter"),
                          (_DOLLAR_PAIR, "a $...$ formula"),
                          (_TEX_COMMAND, "a TeX command or \\( \\[ delimiter")):
        for match in pattern.finditer(text):
            context = " ".join(text[max(0, match.start() - 30):match.end() + 30].split())
            problems.append(f"{where}{what} left unrendered in the text: ...{context}...")
    for tag, content in page.closed_emphasis:
        flat = " ".join(content.split(" "))
        if not flat.strip():
            continue
        if _BAD_EMPHASIS_START.search(flat) or _BAD_EMPHASIS_END.search(flat):
            problems.append(f"{where}<{tag}> that no writer meant (an asterisk inside a "
                            f"formula?): {' '.join(flat.split())[:80]!r}")
    return problems
