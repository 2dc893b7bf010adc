"""parse_memory_breakdown on a captured CPU run and on device rows built from the printf template."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.parsers import ParseError, parse_memory_breakdown

DATA = Path(__file__).resolve().parent.parent / "data" / "stock-cpu"
F = "common_memory_breakdown_print"


def test_captured_cpu_run_has_only_a_host_row() -> None:
    mb = parse_memory_breakdown((DATA / "perplexity-lv4.stderr").read_text())
    assert [r.name for r in mb.rows] == ["Host"]
    host = mb.host
    assert host is not None and host.self_mib == 1 and host.model_mib == 1
    assert mb.devices == () and mb.device_self_mib is None


def _fit_cpp_table() -> str:
    # NOT captured: assembled with common/fit.cpp's templates (no GPU here), padded as it pads columns
    gpu = "%s: | %s | %s = %s + (%s = %s + %s + %s) + %s |"
    other = "%s: | %s | %s   %s    %s = %s + %s + %s    %s |"
    header = "%s: | %s | %s   %s    %s   %s   %s   %s    %s |"
    rows = [
        header % (F, "memory breakdown [MiB]", "total", " free", " self", "model", "context", "compute",
                  "unaccounted"),
        gpu % (F, "  - CUDA0 (RTX 3090)    ", "24135", "  512", "22983", "20480", "   1536", "    967",
               "        640"),
        other % (F, "  - Host                ", "     ", "     ", " 1200", " 1100", "     60", "     40",
                 "           "),
        other % (F, "  - CPU_REPACK          ", "     ", "     ", "  300", "  300", "      0", "      0",
                 "           "),
    ]
    return "0.01.2 I llama_perf_context_print: total time = 5 ms\n" + "\n".join("0.01.3 I " + r for r in rows) + "\n"


def test_device_host_and_other_rows() -> None:
    mb = parse_memory_breakdown(_fit_cpp_table())
    assert [r.name for r in mb.rows] == ["CUDA0 (RTX 3090)", "Host", "CPU_REPACK"]
    (dev,) = mb.devices
    assert (dev.total_mib, dev.free_mib, dev.self_mib, dev.unaccounted_mib) == (24135, 512, 22983, 640)
    assert (dev.model_mib, dev.context_mib, dev.compute_mib) == (20480, 1536, 967)
    assert mb.device_self_mib == 22983
    assert mb.rows[2].self_mib == 300 and not mb.rows[2].is_device


def test_missing_or_damaged_table() -> None:
    with pytest.raises(ParseError, match="-lv 4"):
        parse_memory_breakdown((DATA / "perplexity-nseq2.stderr").read_text())
    bad = _fit_cpp_table().replace("(22983 = 20480", "(22983 = 10480")
    with pytest.raises(ParseError, match="does not add up"):
        parse_memory_breakdown(bad)
    garbled = _fit_cpp_table().replace("+ (22983", "+ [22983")
    with pytest.raises(ParseError, match="unexpected memory breakdown row"):
        parse_memory_breakdown(garbled)


def test_rows_survive_lines_of_other_writers_between_them() -> None:
    # ggml-vulkan's allocation logger (GGML_VK_MEMORY_LOGGER=1) writes to stderr itself while llama.cpp's log
    # thread prints the table: a CI run had its lines between the device row and the Host row
    lines = _fit_cpp_table().splitlines()
    vk = ["ggml_vulkan memory: ggml_backend_vk_buffer_free_buffer()",
          "ggml_vulkan memory: Vulkan0: -34.00 KiB device at 0x55ac34326760. Total device: 16.58 MiB, total host: 0 B"]
    mixed = "\n".join(lines[:3] + vk + lines[3:4] + vk + lines[4:] + vk) + "\n"
    mb = parse_memory_breakdown(mixed)
    assert [r.name for r in mb.rows] == ["CUDA0 (RTX 3090)", "Host", "CPU_REPACK"]
    # a later line of the same function that is not a row still ends the table
    tail = mixed + "0.01.4 I " + F + ": something else\n" + lines[3] + "\n"
    assert [r.name for r in parse_memory_breakdown(tail).rows] == ["CUDA0 (RTX 3090)", "Host", "CPU_REPACK"]
