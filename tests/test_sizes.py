import pytest

from harness.core.errors import HarnessError
from harness.core.sizes import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24G", 24 * 2**30),
        ("24GiB", 24 * 2**30),
        ("24gib", 24 * 2**30),
        ("24GB", 24 * 10**9),
        ("512M", 512 * 2**20),
        ("512MiB", 512 * 2**20),
        ("1.5G", int(1.5 * 2**30)),
        ("4096", 4096),
        ("1T", 2**40),
        (" 8 K ", 8 * 1024),
    ],
)
def test_absolute_sizes(text: str, expected: int) -> None:
    assert parse_size(text).bytes == expected
    assert parse_size(text).fraction is None


def test_percent() -> None:
    s = parse_size("25%")
    assert s.bytes is None and s.fraction == pytest.approx(0.25)
    assert s.resolve(1000) == 250
    assert str(s) == "25%"


@pytest.mark.parametrize("text", ["", "abc", "24X", "-5G", "0", "0%", "150%", "24 G B", "G24"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(HarnessError):
        parse_size(text)


def test_percent_refused_where_absolute_needed() -> None:
    with pytest.raises(HarnessError, match="absolute"):
        parse_size("25%", allow_percent=False)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(24 * 2**30) == "24 GiB"
    assert format_bytes(300 * 2**20) == "300 MiB"
