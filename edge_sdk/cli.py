"""The ``fedsketch`` command.

``fedsketch info``            versions, kernel backend (cython or numpy), shipped artifacts
``fedsketch sketch DATA.npz`` sketch a local dataset (arrays ``x`` and ``y``) and print it
``fedsketch export TARGET``   rebuild a shipped model artifact (needs ``fedsketch[server]``)
``fedsketch keygen DIR``      the server's signing key pair: ``server.key`` (private) and ``server.pub``
                             (``--name ID``: a site aggregator's, ``ID.key`` and ``ID.pub``)
``fedsketch bench``           time the sketch path, a training epoch, message sizes and the broker on this device
``fedsketch predict``         run a kept or exported model on a local .npz file (``--model DIR --data FILE.npz``;
                             ONNX Runtime only)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .install import install_hint


def parse_params(items: Sequence[str]) -> dict[str, Any]:
    """``["eps1=0.4", 'algorithm="hdbscan"', "algorithm=hdbscan"]`` -> keyword arguments.

    Used by ``fedsketch-server --set`` (strategy parameters) and
    ``fedsketch-client --fedcref --set`` (FedCRef client parameters).

    Values are read as TOML (numbers, booleans, quoted strings, arrays); a
    bare word that is no TOML value is taken as a string.
    """
    try:
        import tomllib
    except ImportError:  # pragma: no cover
        import tomli as tomllib  # type: ignore[no-redef]
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.replace("_", "").isalnum():
            raise ValueError(f"--set expects KEY=VALUE with a parameter name as KEY, got {item!r}")
        try:
            out[key] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            if not value.strip() or any(ch in value for ch in "\"'[]{}=#\n"):
                raise ValueError(f"--set {key}: cannot read {value!r} as a TOML value") from None
            out[key] = value.strip()
    return out


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import info

    data = info()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            if isinstance(value, list):
                value = ", ".join(value) if value else "-"
            elif value is None:
                value = "not installed" if key != "models_dir" else "not found"
            print(f"{key:18s} {value}")
    return 0


def _shape_str(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def _sample_shapes(spec: Any) -> list[tuple[int, ...]]:
    """Per-sample shapes an artifact takes: its input shape, and its image shape when that flattens to it."""
    import numpy as np

    shapes = [tuple(spec.input_shape)]
    if spec.image_shape and int(np.prod(spec.image_shape)) == int(np.prod(spec.input_shape)):
        shapes.append(tuple(spec.image_shape))
    return shapes


def pick_encoder(sample_shape: Sequence[int], models_dir: str | None = None) -> str:
    """The shipped encoder (manifest role ``encoder``) whose input fits one sample of ``sample_shape``.

    ``(8, 8)`` or ``(64,)`` -> ``digits_encoder``, ``(28, 28)`` or ``(784,)`` ->
    ``fmnist_fc_encoder``, ``(3, 32, 32)`` -> ``conv_ae_encoder``. Raises
    ValueError, naming every shipped encoder and its input shapes, when none fits.
    """
    from .models.artifacts import load_manifest, models_for_shape

    shape = tuple(int(d) for d in sample_shape)
    encoder = models_for_shape(shape, models_dir)[0]
    if encoder is None:
        encoders = {n: s for n, s in sorted(load_manifest(models_dir).items()) if s.role == "encoder"}
        listed = ", ".join(
            f"{n} ({' or '.join(_shape_str(sh) for sh in _sample_shapes(s))})" for n, s in encoders.items()
        )
        raise ValueError(
            f"no shipped encoder takes samples of shape {_shape_str(shape) or '()'}; the shipped encoders "
            f"and their input shapes: {listed}; give --encoder with an .onnx model for other data"
        )
    return encoder


def _cmd_sketch(args: argparse.Namespace) -> int:
    import numpy as np

    from .encoder import OnnxEncoder
    from .sketch import Sketcher

    with np.load(args.data, allow_pickle=False) as f:
        missing = [k for k in (args.x_key, args.y_key) if k not in f.files]
        if missing:
            raise ValueError(f"{args.data} lacks arrays {missing}; it holds {f.files}")
        x, y = f[args.x_key], f[args.y_key]
    if np.issubdtype(x.dtype, np.integer) and args.scale:
        x = x.astype(np.float32) / float(args.scale)
    encoder = args.encoder
    if encoder is None:
        encoder = pick_encoder(x.shape[1:])
        print(f"fedsketch sketch: encoder {encoder} (fits samples of shape {_shape_str(x.shape[1:])}; "
              "--encoder to choose)", file=sys.stderr)
    enc = OnnxEncoder(encoder, batch_size=args.batch_size)
    sk = Sketcher(enc, args.classes, args.flip_prob, seed=args.seed).sketch(x, y)
    print(
        json.dumps(
            {
                "encoder": enc.spec.name,
                "samples": int(len(y)),
                "n_bits": sk.n_bits,
                "bytes": sk.nbytes,
                "flip_prob": sk.flip_prob,
                "sketch_hex": sk.hex(),
            }
        )
    )
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .protocol import check_id
    from .signing import write_keypair

    name = check_id(args.name, "--name")
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / f"{name}.key", out / f"{name}.pub"
    if private.exists() or public.exists():
        raise ValueError(f"{private} or {public} exists already; remove them to make a new pair "
                         f"(whoever checks its signatures then needs the new {public.name})")
    write_keypair(private, public)
    if name == "server":
        print(f"wrote {private} (keep it on the server: fedsketch-server --signing-key {private})")
        print(f"wrote {public} (give it to every device: fedsketch-client --server-key {public.name})")
    else:
        print(f"wrote {private} (keep it at the site: fedsketch-aggregator --id {name} --key {private})")
        print(f"wrote {public} (give it to the server: fedsketch-server --aggregator-keys DIR, with "
              f"{public.name} in DIR)")
    return 0


#: Entry-point group through which an installed package adds a subcommand: ``name = module:main``,
#: ``main(argv) -> int``. The server side adds ``fedsketch export`` this way (setup.py), so that the
#: device package never imports a server module.
COMMANDS_GROUP = "fedsketch.commands"


def _plugin_commands() -> dict[str, Any]:
    """Subcommands other installed packages register (name -> entry point)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _summary(entry: Any) -> str:
    """First line of an entry point's module docstring, read from its first line (no import: torch stays out)."""
    from importlib.util import find_spec

    module = entry.value.split(":")[0]
    try:
        spec = find_spec(module)
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr]
            first = f.readline().strip().strip('"').strip()
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        first = ""
    return first.rstrip(".") or module


def _run_plugin(name: str, entry: Any, rest: list[str]) -> int:
    try:
        run = entry.load()
    except ImportError as e:
        print(
            f"fedsketch {name} needs the server extra ({e}); install it with: {install_hint('server')}",
            file=sys.stderr,
        )
        return 2
    return int(run(rest) or 0)


def _version_line() -> str:
    from . import __version__, bits

    return f"fedsketch {__version__} (bit kernel: {bits.BACKEND})"


def build_parser(plugins: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsketch", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    p.add_argument("--version", action="version", version=_version_line())
    sub = p.add_subparsers(dest="command", required=True)

    i = sub.add_parser("info", help="versions, kernel backend and shipped artifacts")
    i.add_argument("--json", action="store_true", help="print JSON")

    s = sub.add_parser("sketch", help="sketch a local .npz dataset with arrays x and y")
    s.add_argument("data", help="an .npz file (loaded without pickle)")
    s.add_argument("--encoder", default=None,
                   help="artifact name or .onnx path; default: the shipped encoder that fits the data's shape "
                        "(8x8 or 64: digits_encoder, 28x28 or 784: fmnist_fc_encoder, 3x32x32: conv_ae_encoder)")
    s.add_argument("--classes", type=int, default=10, help="number of classes of the federation")
    s.add_argument("--flip-prob", type=float, default=0.1, help="bit flip probability P in [0, 0.5]")
    s.add_argument("--seed", type=int, default=None, help="seed (default: from the OS)")
    s.add_argument("--batch-size", type=int, default=256)
    s.add_argument("--x-key", default="x")
    s.add_argument("--y-key", default="y")
    s.add_argument("--scale", type=float, default=255.0, help="divide integer images by this")

    k = sub.add_parser("keygen", help="make an Ed25519 signing key pair: the server's (server.key, server.pub) "
                                      "or, with --name, a site aggregator's")
    k.add_argument("dir", help="folder to write NAME.key (mode 600) and NAME.pub into")
    k.add_argument("--name", default="server", help="the key's owner: server, or a site aggregator's id")

    from .bench.options import DESCRIPTION, add_arguments

    b = sub.add_parser("bench", help="time the sketch path, one training epoch, message sizes and the broker here",
                       description=DESCRIPTION)
    add_arguments(b)

    from .models.predict_cli import DESCRIPTION as PREDICT_DESCRIPTION
    from .models.predict_cli import add_arguments as add_predict_arguments

    pr = sub.add_parser("predict", help="run a kept or exported model on a local .npz file (ONNX Runtime)",
                        description=PREDICT_DESCRIPTION)
    add_predict_arguments(pr)

    for name, entry in sorted((_plugin_commands() if plugins is None else plugins).items()):  # export
        sub.add_parser(name, help=f"{_summary(entry)} (fedsketch {name} --help)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugin_commands()  # one look at the installed entry points per run
    parser = build_parser(plugins)
    if argv and argv[0] in plugins:  # its own arguments, its own --help
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        return _run_plugin(argv[0], plugins[argv[0]], argv[1:])
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "sketch":
            return _cmd_sketch(args)
        if args.command == "keygen":
            return _cmd_keygen(args)
        if args.command == "bench":
            from .bench.command import run

            return run(args)
        if args.command == "predict":
            from .models.predict_cli import run as run_predict

            return run_predict(args)
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        print(f"fedsketch {args.command}: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
