"""The usage pages (the service's, one owner's), their CSV and ``manage.py
lmsp_usage``: the same numbers for the same filters, from ``DailyUsage``
rows stored here (the end-to-end test is ``test_usage_e2e``)."""

from __future__ import annotations

import csv
import io
from datetime import date

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.urls import reverse

from ops_app import usage_report
from tasks_app.models import DailyUsage

pytestmark = pytest.mark.django_db

# (owner, model, day, requests, input, output, cached, worker seconds)
DAYS = [
    ("alice", "smollm2:135m", date(2026, 10, 31), 1, 10, 5, 0, 1.5),
    ("alice", "smollm2:135m", date(2026, 11, 1), 2, 20, 8, 4, 2.0),
    ("alice", "other:1b", date(2026, 11, 1), 1, 7, 3, 0, 0.5),
    ("alice", "smollm2:135m", date(2026, 11, 30), 3, 30, 12, 6, 3.25),
    ("bob", "smollm2:135m", date(2026, 11, 2), 4, 40, 16, 0, 4.0),
    ("bob", "smollm2:135m", date(2026, 12, 1), 5, 50, 20, 0, 5.0),
]
NOVEMBER = {"from": "2026-11-01", "to": "2026-11-30"}


@pytest.fixture
def usage() -> dict[str, int]:
    """The rows of ``DAYS``; returns the owners' ids."""
    owners = {name: get_user_model().objects.create_user(name) for name in ("alice", "bob")}
    for owner, model, day, *figures in DAYS:
        DailyUsage.objects.create(
            owner=owners[owner],
            model=model,
            day=day,
            **dict(zip(usage_report.FIGURES, figures, strict=True)),
        )
    return {name: owner.pk for name, owner in owners.items()}


def csv_rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


NOVEMBER_CSV = [
    list(usage_report.COLUMNS),
    ["2026-11-01", "alice", "other:1b", "1", "7", "3", "0", "0.500"],
    ["2026-11-01", "alice", "smollm2:135m", "2", "20", "8", "4", "2.000"],
    ["2026-11-02", "bob", "smollm2:135m", "4", "40", "16", "0", "4.000"],
    ["2026-11-30", "alice", "smollm2:135m", "3", "30", "12", "6", "3.250"],
]


def test_the_report_sums_a_period_by_day_or_month(usage):
    november = usage_report.report(usage_report.filters_from(NOVEMBER))
    assert [(r.period.day, r.owner, r.model, r.requests) for r in november.rows] == [
        (1, "alice", "other:1b", 1),
        (1, "alice", "smollm2:135m", 2),
        (2, "bob", "smollm2:135m", 4),
        (30, "alice", "smollm2:135m", 3),
    ]
    totals = november.totals
    assert (totals.requests, totals.input_tokens, totals.output_tokens) == (10, 97, 39)
    assert (totals.cached_tokens, totals.worker_seconds) == (10, 9.75)
    by_month = usage_report.report(
        usage_report.filters_from({"from": "2026-10-01", "to": "2026-12-31", "by": "month"})
    )
    assert [(r.period, r.owner, r.model, r.input_tokens) for r in by_month.rows] == [
        (date(2026, 10, 1), "alice", "smollm2:135m", 10),
        (date(2026, 11, 1), "alice", "other:1b", 7),
        (date(2026, 11, 1), "alice", "smollm2:135m", 50),
        (date(2026, 11, 1), "bob", "smollm2:135m", 40),
        (date(2026, 12, 1), "bob", "smollm2:135m", 50),
    ]
    assert by_month.tokens_by_model() == {"other:1b": [0, 10, 0], "smollm2:135m": [15, 126, 70]}
    one = usage_report.filters_from({**NOVEMBER, "model": "other:1b"}, usage["alice"])
    assert [r.input_tokens for r in usage_report.report(one).rows] == [7]


def test_presets_name_whole_months_and_bad_filters_are_refused():
    today = date(2026, 12, 15)
    last = usage_report.filters_from({"preset": "last_month"}, today=today)
    assert (last.start, last.end) == (date(2026, 11, 1), date(2026, 11, 30))
    this = usage_report.filters_from({}, today=today)
    assert (this.start, this.end) == (date(2026, 12, 1), today)
    january = usage_report.filters_from({"preset": "last_month"}, today=date(2027, 1, 3))
    assert (january.start, january.end) == (date(2026, 12, 1), date(2026, 12, 31))
    for query in ({"from": "yesterday"}, {"from": "2026-11-02", "to": "2026-11-01"}, {"by": "x"}):
        with pytest.raises(ValueError):
            usage_report.filters_from(query, today=today)


def test_the_service_page_shows_table_totals_chart_and_filters(admin_client, usage):
    html = admin_client.get(reverse("lmsp-usage"), NOVEMBER).content.decode()
    assert html.count('<svg class="lmsp-chart"') == 1
    assert "Input and output tokens per day and model" in html
    table = html[html.index('id="usage-table"') :]
    assert table.count("<tr data-owner=") == 4
    totals = table[table.index('id="usage-totals"') :]
    for figure in ("10", "97", "39", "9.8"):
        assert f'<td class="n">{figure}</td>' in totals
    assert reverse("lmsp-owner-usage", args=[usage["bob"]]) in table
    assert 'href="?from=2026-11-01&amp;to=2026-11-30&amp;by=day&amp;format=csv"' in html
    by_model = admin_client.get(reverse("lmsp-usage"), {**NOVEMBER, "model": "other:1b"})
    assert by_model.content.decode().count("<tr data-owner=") == 1
    bad = admin_client.get(reverse("lmsp-usage"), {"from": "someday"}).content.decode()
    assert 'id="usage-error"' in bad and "from must be a date" in bad


def test_the_csv_has_the_page_s_numbers_for_the_same_filters(admin_client, usage):
    answer = admin_client.get(reverse("lmsp-usage"), {**NOVEMBER, "format": "csv"})
    assert answer["Content-Type"].startswith("text/csv")
    assert "attachment" in answer["Content-Disposition"]
    assert csv_rows(answer.content.decode()) == NOVEMBER_CSV
    owner_url = reverse("lmsp-owner-usage", args=[usage["bob"]])
    bobs = admin_client.get(owner_url, {**NOVEMBER, "format": "csv"}).content.decode()
    assert csv_rows(bobs) == [NOVEMBER_CSV[0], NOVEMBER_CSV[3]]


def test_the_owner_page_shows_only_that_owner_and_is_linked_from_the_user_page(admin_client, usage):
    owner_url = reverse("lmsp-owner-usage", args=[usage["alice"]])
    html = admin_client.get(owner_url, NOVEMBER).content.decode()
    assert "Usage of alice" in html and 'data-owner="bob"' not in html
    assert html.count('data-owner="alice"') == 3
    user_page = admin_client.get(reverse("admin:auth_user_change", args=[usage["alice"]]))
    assert owner_url in user_page.content.decode()
    assert reverse("lmsp-usage") in admin_client.get("/admin/").content.decode()
    assert admin_client.get(reverse("lmsp-owner-usage", args=[999999])).status_code == 404


@pytest.mark.parametrize("name", ["lmsp-usage", "lmsp-owner-usage"])
def test_usage_pages_and_their_csv_need_a_staff_login(client, usage, name):
    url = reverse(name, args=[usage["alice"]] if name == "lmsp-owner-usage" else [])
    client.force_login(get_user_model().objects.get(username="alice"))  # not staff
    for query in ({}, {"format": "csv"}):
        answer = client.get(url, query)
        assert answer.status_code == 302 and "/admin/login/" in answer["Location"]


def test_the_command_prints_the_same_table_and_csv(usage):
    out = io.StringIO()
    call_command(
        "lmsp_usage", "--from", "2026-11-01", "--to", "2026-11-30", "--format", "csv", stdout=out
    )
    assert csv_rows(out.getvalue()) == NOVEMBER_CSV
    out = io.StringIO()
    call_command(
        "lmsp_usage", "--from", "2026-11-01", "--to", "2026-11-30", "--owner", "bob", stdout=out
    )
    lines = out.getvalue().splitlines()
    assert lines[0].split() == list(usage_report.COLUMNS)
    assert lines[1].split() == NOVEMBER_CSV[3]
    assert lines[2].split() == ["total", "4", "40", "16", "0", "4.000"]
    out = io.StringIO()
    call_command(
        "lmsp_usage",
        "--from",
        "2026-10-01",
        "--to",
        "2026-12-31",
        "--by",
        "month",
        "--model",
        "other:1b",
        "--format",
        "csv",
        stdout=out,
    )
    assert csv_rows(out.getvalue())[1:] == [
        ["2026-11", "alice", "other:1b", "1", "7", "3", "0", "0.500"]
    ]
    with pytest.raises(CommandError, match="No user named"):
        call_command("lmsp_usage", "--owner", "nobody")
    with pytest.raises(CommandError, match="after"):
        call_command("lmsp_usage", "--from", "2026-11-02", "--to", "2026-11-01")


# --- issue 46: a permission of their own, cells a spreadsheet would run, bounded periods ---


@pytest.mark.parametrize("name", ["lmsp-usage", "lmsp-owner-usage"])
def test_usage_pages_need_their_own_permission_not_just_staff(client, usage, name):
    url = reverse(name, args=[usage["alice"]] if name == "lmsp-owner-usage" else [])
    staff = get_user_model().objects.create_user("clerk", is_staff=True)
    client.force_login(staff)
    for query in ({}, {"format": "csv"}):
        assert client.get(url, {**NOVEMBER, **query}).status_code == 403
    assert reverse("lmsp-usage") not in client.get("/admin/").content.decode()
    staff.user_permissions.add(Permission.objects.get(codename="view_dailyusage"))
    client.force_login(get_user_model().objects.get(pk=staff.pk))  # permissions read again
    assert client.get(url, NOVEMBER).status_code == 200
    assert reverse("lmsp-usage") in client.get("/admin/").content.decode()


FORMULAS = ["=1+1", "+1+1", "-1+1", "@SUM(A1)", "\tx", "\rx"]


def test_csv_cells_a_spreadsheet_would_run_arrive_as_text(admin_client):
    for number, name in enumerate(FORMULAS):
        # names the admin's form would refuse, stored by other means (a shell, an import)
        owner = get_user_model().objects.create_user(name)
        DailyUsage.objects.create(
            owner=owner, model="=cmd|' /C calc'!A0", day=date(2026, 11, number + 1)
        )
    answer = admin_client.get(reverse("lmsp-usage"), {**NOVEMBER, "format": "csv"})
    rows = csv_rows(answer.content.decode())[1:]
    assert [row[1] for row in rows] == ["'" + name for name in FORMULAS]
    assert {row[2] for row in rows} == {"'=cmd|' /C calc'!A0"}
    out = io.StringIO()
    call_command(
        "lmsp_usage", "--from", "2026-11-01", "--to", "2026-11-30", "--format", "csv", stdout=out
    )
    assert [row[1] for row in csv_rows(out.getvalue())[1:]] == ["'" + name for name in FORMULAS]


def test_a_period_is_at_most_366_days(admin_client, usage):
    leap_year = {"from": "2024-01-01", "to": "2024-12-31"}  # 366 days
    assert usage_report.filters_from(leap_year).end == date(2024, 12, 31)
    for too_long in (
        {"from": "2024-01-01", "to": "2025-01-01"},
        {"from": "0001-01-01", "to": "9999-12-31"},
    ):
        with pytest.raises(ValueError, match="a period is at most 366 days"):
            usage_report.filters_from(too_long)
        html = admin_client.get(reverse("lmsp-usage"), too_long).content.decode()
        assert 'id="usage-error"' in html and "a period is at most 366 days" in html
        csv_answer = admin_client.get(reverse("lmsp-usage"), {**too_long, "format": "csv"})
        assert not csv_answer["Content-Type"].startswith("text/csv")  # the page, saying why
    with pytest.raises(CommandError, match="at most 366 days"):
        call_command("lmsp_usage", "--from", "0001-01-01", "--to", "9999-12-31")
