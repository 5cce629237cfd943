"""The published figures: `docs/results/records.jsonl` holds one record per figure (table, row, column, value,
unit, the ceiling or peer beside it, date, commit, device, command); the tables of docs/results.md and the
headline table of README.md are rendered from it between `<!-- records: NAME -->` and `<!-- /records -->`.

    python -m tools results            # exit 1 if a rendered table differs from its records (CI runs this check)
    python -m tools results --write    # render the tables into the documents
    python -m tools results --add FILE.jsonl   # append new records (each checked), then --write
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "results" / "records.jsonl"
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "results.md")
FIELDS = ("table", "row", "column", "value", "unit", "beside", "date", "commit", "device", "command")
# README's headline table: (label, table, row, columns joined with " / ").
HEADLINE = (
    ("`check --suite full`: differing bits, Pallas Triton backend / Mosaic GPU (H100)", "parity",
     ("check --suite full, Pallas on its Triton backend", "check --suite full, Pallas on Mosaic GPU"),
     ("differing bits",)),
    ("2-way merge T = 32K, Triton plain / + LSE / fused, % of 2R1W", "merge_2way", ("T = 32K",),
     ("Triton plain", "Triton + LSE", "Triton fused")),
    ("2-way merge T = 32K, Pallas plain / + LSE / fused, % of 2R1W", "merge_2way", ("T = 32K",),
     ("Pallas plain", "Pallas + LSE", "Pallas fused")),
    ("N-way merge N = 8, T = 32K, Triton plain / + LSE / fused, %", "merge_n", ("N = 8, T = 32K",),
     ("Triton plain", "Triton + LSE", "Triton fused")),
    ("N-way merge N = 256, T = 8K, Triton / Pallas plain, %", "merge_n_large", ("N = 256, T = 8K",),
     ("Triton plain", "Pallas plain")),
    ("mask, LSE only, Triton, 2k / 32k / 131k, us", "mask", ("LSE only, Triton, us",),
     ("2k_balanced", "32k_balanced", "131k_skewed")),
    ("first call (compile included), worst variant, N = 4 / 16 / 64 / 256, Triton, s", "first_call", ("Triton",),
     ("N = 4", "N = 16", "N = 64", "N = 256")),
    ("first call, Pallas, s", "first_call", ("Pallas",), ("N = 4", "N = 16", "N = 64", "N = 256")),
    ("eager Triton merge at T = 2K (launch included): plain / + LSE / fused, us", "eager",
     ("Triton merge, T = 2K",), ("plain", "+ LSE", "fused")),
    ("corrupted rows on cuDNN partials (finite LSE in empty rows): no mask / mask or fused", "demo",
     ("cuDNN partials (finite LSE in empty rows)",), ("no mask", "mask or fused")),
)
_BLOCK = re.compile(r"(<!-- records: (\w+) -->\n)(.*?)(<!-- /records -->)", re.S)


def load(path: Path = RECORDS) -> list[dict]:
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            records.append(check_record(json.loads(line), f"{path.name}:{n}"))
    return records


def check_record(record: dict, where: str) -> dict:
    missing = [f for f in FIELDS if not str(record.get(f, "")).strip()]
    extra = sorted(set(record) - set(FIELDS))
    if missing or extra:
        raise ValueError(f"{where}: missing fields {missing}, unknown fields {extra}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]):
        raise ValueError(f"{where}: date {record['date']!r} is not YYYY-MM-DD")
    if not re.fullmatch(r"[0-9a-f]{7,40}", record["commit"]):
        raise ValueError(f"{where}: commit {record['commit']!r} is not a git hash")
    return record


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _provenance(records) -> str:
    devices = _ordered(r["device"] for r in records)
    if len(devices) == 1:  # one device: named once
        runs = _ordered((r["date"], r["commit"], r["command"]) for r in records)
        return f"on {devices[0]}: " + "; ".join(f"{d}, `{c}`: `{cmd}`" for d, c, cmd in runs)
    runs = _ordered((r["date"], r["commit"], r["device"], r["command"]) for r in records)
    return "; ".join(f"{d}, `{c}`, {dev}: `{cmd}`" for d, c, dev, cmd in runs)


def render_table(records: list[dict], name: str) -> str:
    rows = [r for r in records if r["table"] == name]
    if not rows:
        raise ValueError(f"no records of table {name!r}")
    columns = _ordered(r["column"] for r in rows)
    units = _ordered(r["unit"] for r in rows)
    cell = {(r["row"], r["column"]): r for r in rows}
    besides = _ordered(r["beside"] for r in rows)
    shared = len(besides) == 1  # one ceiling or peer for the table: said under it, not per row
    out = ["| " + " | ".join([""] + columns + ([] if shared else ["ceiling or peer"])) + " |",
           "|---" + "|---:" * len(columns) + ("" if shared else "|---") + "|"]
    for row in _ordered(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == row]
        label = row if len(units) == 1 else f"{row} ({'; '.join(_ordered(r['unit'] for r in mine))})"
        values = [cell[(row, c)]["value"] if (row, c) in cell else "" for c in columns]
        beside = [] if shared else ["; ".join(_ordered(r["beside"] for r in mine))]
        out.append("| " + " | ".join([label] + values + beside) + " |")
    lines = "\n".join(out)
    unit = f"Unit: {units[0]}. " if len(units) == 1 else ""
    beside = f"Beside: {besides[0]}. " if shared else ""
    return f"{lines}\n\n{unit}{beside}Measured: {_provenance(rows)}.\n"


def render_headline(records: list[dict]) -> str:
    out = ["| figure | value | ceiling or peer | measured |", "|---|---:|---|---|"]
    for label, table, rows, columns in HEADLINE:
        picked = [r for row in rows for c in columns for r in records
                  if r["table"] == table and r["row"] == row and r["column"] == c]
        if len(picked) != len(rows) * len(columns):
            raise ValueError(f"headline {label!r}: {len(picked)} records, {len(rows) * len(columns)} wanted")
        when = "; ".join(_ordered(f"{r['date']}, `{r['commit']}`" for r in picked))
        out.append(f"| {label} | {' / '.join(r['value'] for r in picked)} | "
                   f"{'; '.join(_ordered(r['beside'] for r in picked))} | {when} |")
    return "\n".join(out) + "\n"


def render(text: str, records: list[dict]) -> str:
    def block(m: re.Match) -> str:
        name = m.group(2)
        body = render_headline(records) if name == "headline" else render_table(records, name)
        return m.group(1) + body + m.group(4)
    return _BLOCK.sub(block, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools results", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="render the tables into README.md and docs/results.md")
    p.add_argument("--add", metavar="FILE", help="append the records of FILE (JSON lines) to the records")
    args = p.parse_args(argv)
    records = load()
    if args.add:
        new = load(Path(args.add))
        with RECORDS.open("a") as f:
            for r in new:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        records += new
        print(f"{len(new)} records added")
    stale = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        rendered = render(text, records)
        if rendered != text:
            if args.write:
                doc.write_text(rendered)
                print(f"rendered {doc.relative_to(ROOT)}")
            else:
                stale.append(str(doc.relative_to(ROOT)))
    if stale:
        print(f"tables out of date with {RECORDS.relative_to(ROOT)}: {', '.join(stale)} "
              "(python -m tools results --write)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
