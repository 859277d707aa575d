"""Build script of FedSketch (distribution name ``fedsketch``).

The plain install is the edge profile (numpy, ONNX Runtime, paho-mqtt,
safetensors: no torch), and compiles ``ext/bits.pyx`` into ``edge_sdk._bits``.
If no C compiler is available the build goes on without it and the package
uses its pure-numpy twin (same bits, slower); ``fedsketch info`` says which.

Environment switches:
  FEDSKETCH_NO_EXT=1        skip the extension entirely
  FEDSKETCH_CYTHON_DEBUG=1  bounds checks and wraparound back on, no -O3
  FEDSKETCH_NATIVE=1        add -march=native (build on the device you run on)
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    ns: dict[str, str] = {}
    with open(os.path.join(HERE, "edge_sdk", "_version.py")) as f:
        exec(f.read(), ns)
    return ns["__version__"]


class OptionalBuildExt(build_ext):
    """Build the extension, but fall back to pure numpy if compiling fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any toolchain failure
            self._warn(e)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self._warn(e)

    @staticmethod
    def _warn(e: Exception) -> None:
        sys.stderr.write(
            f"WARNING: could not compile the FedSketch bit kernels ({e}); "
            "the pure-numpy fallback will be used (identical results, slower).\n"
        )


def _extensions():
    if os.environ.get("FEDSKETCH_NO_EXT"):
        return []
    import numpy  # noqa: F401 - build requirement, ensures the toolchain env is sane
    from Cython.Build import cythonize
    from setuptools import Extension

    debug = bool(os.environ.get("FEDSKETCH_CYTHON_DEBUG"))
    args: list[str] = []
    if sys.platform != "win32":
        args = ["-O0", "-g"] if debug else ["-O3"]
        machine = platform.machine().lower()
        if os.environ.get("FEDSKETCH_NATIVE"):
            args.append("-march=native")
        elif machine in ("x86_64", "amd64"):
            args.append("-mpopcnt")
    ext = Extension("edge_sdk._bits", ["ext/bits.pyx"], extra_compile_args=args)
    return cythonize(
        [ext],
        compiler_directives={
            "language_level": 3,
            "boundscheck": debug,
            "wraparound": debug,
            "initializedcheck": debug,
            "cdivision": True,
            "embedsignature": True,
        },
    )


EDGE = [
    "numpy>=1.24", "onnxruntime>=1.17", "paho-mqtt>=2.0", "safetensors>=0.4",
    "cryptography>=41",  # Ed25519: devices verify what their server signs
    "tomli>=1.1; python_version < '3.11'",  # TOML values of --set and --config before Python 3.11
]
# On aarch64 (a Raspberry Pi) the index's newer torch wheels are CUDA builds (3.2 GB, and their BLAS dies with
# SIGILL on a Pi 4's cores); torch 2.9.1 is the index's last CPU build for aarch64 (about 723 MB installed).
TRAIN = ["torch>=2.1; platform_machine != 'aarch64'", "torch==2.9.1; platform_machine == 'aarch64'"]
SERVER = TRAIN + [
    "onnx>=1.15",
    "onnxscript>=0.1",
    "scikit-learn>=1.3",
    "threadpoolctl>=3.1",  # server_kit.cores: each process's BLAS/OpenMP pools sized to its share
    "scikit-optimize>=0.10",
    "hdbscan>=0.8.33",
    "matplotlib>=3.7",
    "scipy>=1.10",
    "tqdm>=4.60",
    "msgpack>=1.0",
    "prometheus-client>=0.20",
    "dp-accounting>=0.4",  # server_kit.privacy.accountant: the RDP accountant of DP-FedAvg's rounds
]
BROKER = ["amqtt>=0.11"]
# Flower's Simulation Engine (Ray) and runtime, pinned: edge_sdk.flower and server_kit.flower, nothing else.
# flwr's CLI needs a typer of 0.16 to 0.20 (its pin says >=0.13, but `flwr` fails on older ones); amqtt pins
# typer==0.15.4 (0.11) or >=0.24 (0.12) for its own command-line scripts only, which FedSketch does not use:
# so `flower` is installed after `broker`, not with it (the Makefile does; see the README, "Flower").
FLOWER = ["flwr[simulation]==1.41.0; python_version >= '3.10'", "typer>=0.20,<0.21; python_version >= '3.10'"]
DEV = ["pytest>=8", "pytest-xdist>=3.5", "ruff>=0.5", "Cython>=3.0", "hypothesis>=6.80"]

setup(
    name="fedsketch",
    version=_version(),
    description="Clustered federated learning from tiny autoencoder sketches, for edge fleets",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    # every package under edge_sdk/ and server_kit/ (a test checks the wheel holds them all)
    packages=find_packages(include=["edge_sdk", "edge_sdk.*", "server_kit", "server_kit.*"])
    + ["edge_sdk.artifacts_data"],
    package_dir={"edge_sdk.artifacts_data": "models"},
    package_data={"edge_sdk.artifacts_data": ["*.onnx", "*.safetensors", "manifest.json", "README.md"]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    install_requires=EDGE,
    extras_require={
        "train": TRAIN,
        "server": SERVER,
        "broker": BROKER,
        "dev": DEV,
        "flower": FLOWER,
        "all": sorted(set(SERVER + BROKER + DEV)),
    },
    entry_points={
        "console_scripts": [
            "fedsketch=edge_sdk.cli:main",
            "fedsketch-client=edge_sdk.client.cli:main",
            "fedsketch-data=server_kit.data.split:main",
            "fedsketch-server=server_kit.cli:main",
            "fedsketch-aggregator=server_kit.partials.cli:main",
        ],
        # subcommands of `fedsketch` that live on the server side (edge_sdk.cli.COMMANDS_GROUP)
        "fedsketch.commands": ["export=server_kit.export:main"],
    },
    zip_safe=False,
)
