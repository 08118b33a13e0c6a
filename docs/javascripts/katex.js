// Renders the formulas on every page with KaTeX. pymdownx.arithmatex (generic mode) has
// turned each $...$ of the Markdown into <span class="arithmatex">\(...\)</span> and each
// $$...$$ into <div class="arithmatex">\[...\]</div>; only those elements are rendered,
// so a dollar sign elsewhere on a page stays text.
document$.subscribe(() => {
  for (const element of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
});
