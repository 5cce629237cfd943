"""The published figures' records (docs/results/records.jsonl) and the tables rendered from them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import results  # noqa: E402


def test_every_table_agrees_with_its_records():
    done = subprocess.run([sys.executable, "-m", "tools", "results"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_record_names_its_run_and_every_table_is_shown():
    records = results.load()
    shown = set()
    for doc in results.DOCUMENTS:
        shown |= {m.group(2) for m in results._BLOCK.finditer(doc.read_text())}
    assert {r["table"] for r in records} <= shown, "a table of records no document shows"
    assert "headline" in shown


def test_a_stale_table_is_found_and_rendered_back():
    records = results.load()
    text = "<!-- records: mask -->\nold\n<!-- /records -->\n"
    rendered = results.render(text, records)
    assert "old" not in rendered and "7.94" in rendered
    assert results.render(rendered, records) == rendered


@pytest.mark.parametrize("change, message", [
    ({"commit": "tip of main"}, "not a git hash"),
    ({"date": "last Monday"}, "not YYYY-MM-DD"),
    ({"beside": ""}, "missing fields ['beside']"),
    ({"note": "x"}, "unknown fields ['note']"),
])
def test_a_record_without_its_provenance_is_refused(tmp_path, change, message):
    record = dict(results.load()[0], **change)
    path = tmp_path / "new.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        results.load(path)
