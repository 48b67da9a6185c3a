"""Prints the README's table of cluster-file fields from the schema
(hetpar/cluster/schema.py); with --write, replaces the table between the README's
cluster-fields markers. tests/test_catalog.py checks the README has this table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetpar.cluster.schema import fields_table

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- cluster-fields:start -->\n", "<!-- cluster-fields:end -->"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args()
    table = fields_table()
    if not args.write:
        sys.stdout.write(table + "\n")
        return 0
    text = README.read_text()
    if START not in text or END not in text:
        sys.stderr.write(f"README.md lacks the markers {START.strip()} and {END}\n")
        return 1
    head, rest = text.split(START, 1)
    README.write_text(head + START + table + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
