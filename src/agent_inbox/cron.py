"""Cron expressions for recurring timers, evaluated in a named time zone.

Five fields: minute hour day-of-month month day-of-week, each `*`, a number, a
range `a-b`, a list `a,b`, or a step `*/n` / `a-b/n`; day-of-week 0-7 (0 and 7 are
Sunday). As in Vixie cron, when both day fields are restricted a day matches if
either does. Occurrences are whole minutes of local time converted to epoch
seconds: a local time skipped by a DST change does not occur; a repeated one
occurs once (its first instant).
"""

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agent_inbox import errors

_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
           ("day of week", 0, 7))
# Far enough for any valid schedule (Feb 29 on a Monday recurs within 28 years).
_SEARCH_DAYS = 366 * 29


def _parse_field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        step = int(step_text) if step_text.isdigit() and int(step_text) > 0 else None
        if step_text and step is None:
            raise ValueError(f"bad step in {name} field: {part!r}")
        if body == "*":
            start, end = low, high
        elif "-" in body:
            start_text, _, end_text = body.partition("-")
            if not (start_text.isdigit() and end_text.isdigit()):
                raise ValueError(f"bad range in {name} field: {part!r}")
            start, end = int(start_text), int(end_text)
        elif body.isdigit():
            start = end = int(body)
            if step:
                end = high
        else:
            raise ValueError(f"bad {name} field: {part!r}")
        if not (low <= start <= end <= high):
            raise ValueError(f"{name} field {part!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step or 1))
    return frozenset(values)


@dataclass(frozen=True)
class Schedule:
    expression: str
    zone: ZoneInfo
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool
    any_weekday: bool

    def _day_matches(self, day: datetime) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        in_week = (day.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return in_month and in_week
        return in_month or in_week

    def next_after(self, after: int) -> int:
        """The first occurrence strictly after epoch second `after`."""
        try:
            return self._next_after(after)
        except (OverflowError, OSError, ValueError):  # past what datetime can hold
            raise errors.InvalidTimer("cron", self.expression,
                                      f"has no occurrence after {after} before the year 9999") from None

    def _next_after(self, after: int) -> int:
        start = datetime.fromtimestamp(after, self.zone).replace(hour=0, minute=0, second=0,
                                                                 microsecond=0, tzinfo=None)
        for offset in range(_SEARCH_DAYS):
            day = start + timedelta(days=offset)
            if not self._day_matches(day):
                continue
            for hour in sorted(self.hours):
                for minute in sorted(self.minutes):
                    instant = self._instant(day.replace(hour=hour, minute=minute))
                    if instant is not None and instant > after:
                        return instant
        raise errors.InvalidTimer("cron", self.expression, "never occurs")

    def _instant(self, local: datetime) -> int | None:
        """Epoch seconds of a local wall time; None if DST skips it."""
        aware = local.replace(tzinfo=self.zone, fold=0)
        back = aware.astimezone(timezone.utc).astimezone(self.zone).replace(tzinfo=None)
        if back != local:
            return None
        return int(aware.timestamp())


def parse(expression: str, zone_name: str = "UTC") -> Schedule:
    """A Schedule, or errors.InvalidTimer naming what is wrong."""
    if not isinstance(expression, str):
        raise errors.InvalidTimer("cron", expression, "must be a string")
    try:
        zone = ZoneInfo(zone_name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise errors.InvalidTimer("timezone", zone_name,
                                  "is not a known time zone on this host") from None
    fields = expression.split()
    if len(fields) != 5:
        raise errors.InvalidTimer("cron", expression,
                                  "must have 5 fields: minute hour day-of-month month day-of-week")
    try:
        minutes, hours, days, months, weekdays = (
            _parse_field(text, name, low, high) for text, (name, low, high) in zip(fields, _FIELDS))
    except ValueError as exc:
        raise errors.InvalidTimer("cron", expression, str(exc)) from None
    weekdays = frozenset(d % 7 for d in weekdays)
    schedule = Schedule(expression, zone, minutes, hours, days, months, weekdays,
                        any_day=fields[2] == "*", any_weekday=fields[4] == "*")
    return schedule
