"""Command-line helpers the benchmark scripts share (imported as ``_cli``: the scripts' folder is on the path)."""

from __future__ import annotations

import argparse


def csv_list(kind, choices=None):
    """An argparse type: a comma-separated list of ``kind`` values, each in ``choices`` when given."""

    def parse(text: str):
        items = [kind(v) for v in text.split(",") if v]
        bad = [v for v in items if choices is not None and v not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(choices or [])}, "
                                             f"got {text!r}")
        return items

    return parse
