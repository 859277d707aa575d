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


def seed_list(text: str) -> list[int]:
    """An argparse type for ``--seeds``: ``"3"`` is seeds 0, 1, 2 (a count); ``"4,7"`` or ``"5,"`` those seeds."""
    text = text.strip()
    try:
        seeds = list(range(int(text))) if text.isdigit() else [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes a count or a comma-separated list, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seeds names no seed: {text!r} (a count >= 1, or a list like '5,')")
    return seeds


def add_device_options(ap: argparse.ArgumentParser) -> None:
    """``--device`` (where simulated devices train), ``--batched``/``--sequential`` and ``--step`` (how a round's clients do)."""
    from server_kit.cli_options import device_name

    ap.add_argument("--device", type=device_name, default="auto",
                    help="auto, cpu or cuda: where the simulated devices train (auto: CUDA when torch sees it)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--batched", dest="batched", action="store_true", default=None,
                     help="train a round's clients together (default on a GPU)")
    how.add_argument("--sequential", dest="batched", action="store_false",
                     help="train a round's clients one by one (default on the CPU)")
    ap.add_argument("--step", choices=("eager", "compile", "graphs"), default="eager",
                    help="how batched steps run: eager, compile (torch.compile, seconds per shape first) or graphs "
                         "(compiled, replayed as CUDA graphs on a GPU) (default: eager)")
