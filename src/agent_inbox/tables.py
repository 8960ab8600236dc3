"""Readable tables and times for the operator commands."""

import datetime

MAX_CELL = 60


def format_table(headers: list[str], rows: list[list]) -> str:
    """Columns padded to their widest cell; numbers right-aligned; None as '-';
    control characters escaped (cells hold provider data); long text cut."""
    cells = [[cell(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [any(is_number(r[i]) for r in rows)
               and all(is_number(r[i]) or r[i] is None for r in rows)
               for i in range(len(headers))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if right else v.ljust(w)
                         for v, w, right in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def is_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cell(value) -> str:
    if value is None:
        return "-"
    text = str(value)
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


def when(epoch: int) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):  # past year 9999
        return str(epoch)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def duration(seconds: int) -> str:
    """'1d 2h', '3m 5s', '45s': the two largest units."""
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return " ".join(parts[:2])


def relative(seconds: int) -> str:
    if seconds == 0:
        return "now"
    return f"in {duration(seconds)}" if seconds > 0 else f"{duration(-seconds)} ago"
