"""CPU feature detection: torch runs on one thread on a CPU without LSE atomics (Raspberry Pi 4)."""

from __future__ import annotations

import logging

import pytest

from edge_sdk import cpu

# /proc/cpuinfo of a Raspberry Pi 4 Model B, 64-bit Raspberry Pi OS (first and last blocks)
PI4 = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd08
CPU revision\t: 3

processor\t: 1
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd08
CPU revision\t: 3

Hardware\t: BCM2835
Revision\t: c03111
Serial\t\t: 100000003c1e8f0e
Model\t\t: Raspberry Pi 4 Model B Rev 1.1
"""

# Raspberry Pi 5 (Cortex-A76, ARMv8.2: has LSE)
PI5 = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x4
CPU part\t: 0xd0b
CPU revision\t: 1

Revision\t: c04170
Serial\t\t: 6b71acd964ee2481
Model\t\t: Raspberry Pi 5 Model B Rev 1.0
"""

X86 = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz
stepping\t: 7
cpu MHz\t\t: 2499.998
cache size\t: 36608 KB
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr \
sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid \
tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c \
rdrand hypervisor lahf_lm abm 3dnowprefetch avx2 avx512f avx512dq
bugs\t\t: spectre_v1 spectre_v2 spec_store_bypass swapgs
"""

MESSAGE = "this CPU lacks LSE atomics (Cortex-A72, Raspberry Pi 4): torch runs on one thread"


@pytest.fixture(autouse=True)
def _fresh_warning(monkeypatch):
    monkeypatch.setattr(cpu, "_warned", False)


def test_features_of_each_cpu():
    assert cpu.cpu_features(PI4) == {"fp", "asimd", "evtstrm", "crc32", "cpuid"}
    assert "atomics" in cpu.cpu_features(PI5)
    assert {"avx2", "popcnt", "sse4_2"} <= cpu.cpu_features(X86)
    assert cpu.cpu_features("") == frozenset()


def test_which_cpus_lack_lse_atomics():
    assert cpu.lacks_lse_atomics(PI4)
    assert not cpu.lacks_lse_atomics(PI5)
    assert not cpu.lacks_lse_atomics(X86)  # x86 has no such flag and needs none
    assert not cpu.lacks_lse_atomics("")  # nothing known: not limited


def test_names():
    assert cpu.describe_cpu(PI4) == "Cortex-A72, Raspberry Pi 4"
    assert cpu.describe_cpu(PI5) == "Cortex-A76, Raspberry Pi 5"
    assert cpu.describe_cpu(X86).startswith("Intel(R) Xeon(R)")


def test_read_cpuinfo_without_the_file(tmp_path):
    assert cpu.read_cpuinfo(str(tmp_path / "missing")) == ""


def test_pi4_gets_one_thread_and_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="edge_sdk.cpu"):
        assert cpu.torch_threads(4, PI4) == 1
        assert cpu.torch_threads(None, PI4) == 1  # torch's default would be one per core
        assert cpu.torch_threads(1, PI4) == 1
    warnings = [r for r in caplog.records if r.name == "edge_sdk.cpu"]
    assert [r.getMessage() for r in warnings] == [MESSAGE]
    assert warnings[0].levelno == logging.WARNING


def test_other_cpus_keep_the_request(caplog):
    with caplog.at_level(logging.WARNING, logger="edge_sdk.cpu"):
        assert cpu.torch_threads(4, PI5) == 4
        assert cpu.torch_threads(None, PI5) is None
        assert cpu.torch_threads(2, X86) == 2
        assert cpu.torch_threads(None, X86) is None
    assert not [r for r in caplog.records if r.name == "edge_sdk.cpu"]


def test_this_machine_reads_cpuinfo_only_on_arm(monkeypatch):
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu, "read_cpuinfo", lambda path=cpu.CPUINFO: PI4)
    assert cpu.torch_threads(3) == 3
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    assert cpu.torch_threads(3) == 1


def test_trainer_uses_one_thread_on_a_pi4(monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    from edge_sdk.training import torch_support

    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu, "read_cpuinfo", lambda path=cpu.CPUINFO: PI4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with caplog.at_level(logging.WARNING, logger="edge_sdk.cpu"):
            with torch_support.using_threads(torch, 2):
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 2
            with torch_support.using_threads(torch, None):  # "torch's default" is not safe either
                assert torch.get_num_threads() == 1
        assert [r.getMessage() for r in caplog.records if r.name == "edge_sdk.cpu"] == [MESSAGE]
        with pytest.raises(ValueError):  # bad values still fail, on any CPU
            with torch_support.using_threads(torch, 0):
                pass
    finally:
        torch.set_num_threads(before)
