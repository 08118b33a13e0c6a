"""Markdown table of two rounds_per_sec.py results, old vs new.

Usage:
  python benchmarks/compare_runs.py old.json new.json [--threshold 0.05] [--fail-on-slower]
  python benchmarks/rounds_per_sec.py --pair old.json new.json   # the same table

For each (m, n, d, k) in both files: the vectorized seconds per round, old
and new, and new/old; then the sweep cell's seconds per seed (and the 40-seed
figure) and the comparison row's `comparison_seconds` where both runs have
them. A row whose new time is more than `threshold` (5 %) above the old one
is flagged. Reads the list layout rounds_per_sec.py writes (every object
carrying `meta`; results since 8121080), and a {"meta": ..., "rows": [...]}
wrapper too.
"""

from __future__ import annotations

import argparse
import json
import sys


def load_run(path: str) -> tuple[dict, list[dict], list[dict]]:
    """(meta, config rows, other objects) of a rounds_per_sec.py JSON file."""
    with open(path) as f:
        payload = json.load(f)
    if isinstance(payload, dict):
        meta, objects = payload.get("meta") or {}, payload.get("rows") or []
    else:
        objects = payload
        meta = next((o["meta"] for o in objects if isinstance(o.get("meta"), dict)), {})
    configs = [o for o in objects if all(key in o for key in ("m", "n", "d", "k"))]
    others = [o for o in objects if o not in configs]
    return meta, configs, others


def _sec(x) -> str:
    return "–" if x is None else f"{x:.4g}"


def _ratio(old, new, threshold: float) -> tuple[str, str, bool]:
    """(ratio text, flag text, slower?) of new over old."""
    if old is None or new is None or old <= 0:
        return "–", "", False
    ratio = new / old
    slower = ratio > 1 + threshold
    return f"{ratio:.3f}", (f"**slower by {100 * (ratio - 1):.0f} %**" if slower else ""), slower


def _describe(name: str, meta: dict) -> str:
    load = meta.get("loadavg_start"), meta.get("loadavg_end")
    load_text = "–" if None in load else f"{load[0][0]:.2f} → {load[1][0]:.2f}"
    return (
        f"* **{name}**: {meta.get('checkout', '?')} at git {meta.get('git_head')}"
        f"{' (dirty)' if meta.get('git_dirty') else ''}, sources "
        f"`{meta.get('fedjax_sim_sources_sha256')}`; {meta.get('date_utc')}, "
        f"{meta.get('cpu_model') or meta.get('device')}, 1-min load {load_text}"
        f"{' [quick]' if meta.get('quick') else ''}"
    )


def compare(old_path: str, new_path: str, threshold: float = 0.05) -> tuple[str, int]:
    """(Markdown text, number of flagged rows)."""
    old_meta, old_rows, old_other = load_run(old_path)
    new_meta, new_rows, new_other = load_run(new_path)
    by_shape = {(r["m"], r["n"], r["d"], r["k"]): r for r in old_rows}
    lines = [
        _describe("old", old_meta),
        _describe("new", new_meta),
        "",
        f"| m | n | d | k | old s/round | new s/round | new/old | flag (> {100 * threshold:g} %) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    flagged = 0
    for new in new_rows:
        shape = (new["m"], new["n"], new["d"], new["k"])
        old = by_shape.pop(shape, None)
        old_s = old and old.get("vectorized_s_per_round")
        new_s = new.get("vectorized_s_per_round")
        ratio, flag, slower = _ratio(old_s, new_s, threshold)
        flagged += slower
        lines.append(
            f"| {' | '.join(map(str, shape))} | {_sec(old_s)} | {_sec(new_s)} | {ratio} | "
            f"{flag if old else 'not in old'} |"
        )
    for shape in by_shape:
        lines.append(f"| {' | '.join(map(str, shape))} | "
                     f"{_sec(by_shape[shape].get('vectorized_s_per_round'))} | – | – | "
                     "not in new |")

    old_cell = next((r["sweep_cell"] for r in old_rows if "sweep_cell" in r), None)
    new_cell = next((r["sweep_cell"] for r in new_rows if "sweep_cell" in r), None)
    if old_cell or new_cell:
        lines += ["", "| sweep cell | old | new | new/old | flag |", "|---|---:|---:|---:|---|"]
        for key, label in (("seconds_per_seed", "seconds per seed"),
                           ("official_40_seed_seconds", "40 seeds, s")):
            old_s = old_cell.get(key) if old_cell else None
            new_s = new_cell.get(key) if new_cell else None
            ratio, flag, slower = _ratio(old_s, new_s, threshold)
            flagged += slower and key == "seconds_per_seed"
            lines.append(f"| {label} | {_sec(old_s)} | {_sec(new_s)} | {ratio} | {flag} |")
        for name, cell in (("old", old_cell), ("new", new_cell)):
            if cell:
                lines.append(f"\n{name}: {cell.get('seeds_measured')} seed(s) measured; 40 seeds "
                             f"{cell.get('official_40_seed_seconds_is')}")

    old_cmp = next((o for o in old_other if o.get("kind") == "comparison"), None)
    new_cmp = next((o for o in new_other if o.get("kind") == "comparison"), None)
    if old_cmp or new_cmp:
        def seconds_or_why(row):
            if row is None:
                return None, "not run"
            return row.get("comparison_seconds"), row.get("error") or row.get("skipped") or ""

        old_s, old_why = seconds_or_why(old_cmp)
        new_s, new_why = seconds_or_why(new_cmp)
        ratio, flag, slower = _ratio(old_s, new_s, threshold)
        flagged += slower
        command = (new_cmp or old_cmp).get("command")
        lines += [
            "",
            f"| comparison row (`{command}`) | old | new | new/old | flag |",
            "|---|---:|---:|---:|---|",
            f"| seconds | {_sec(old_s)} | {_sec(new_s)} | {ratio} | {flag} |",
        ]
        for name, why in (("old", old_why), ("new", new_why)):
            if why:
                lines.append(f"\n{name} comparison row: {why}")
    lines += ["", f"{flagged} row(s) more than {100 * threshold:g} % slower."]
    if old_meta.get("quick") or new_meta.get("quick"):
        lines.append("(a --quick run: its timings are a smoke test, too short to compare.)")
    return "\n".join(lines), flagged


def markdown(old_path: str, new_path: str, threshold: float = 0.05) -> str:
    return compare(old_path, new_path, threshold)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--threshold", type=float, default=0.05,
                        help="flag rows whose new time exceeds old × (1 + threshold)")
    parser.add_argument("--fail-on-slower", action="store_true",
                        help="exit 1 when any row is flagged")
    args = parser.parse_args(argv)
    text, flagged = compare(args.old, args.new, args.threshold)
    print(text)
    return 1 if args.fail_on_slower and flagged else 0


if __name__ == "__main__":
    sys.exit(main())
