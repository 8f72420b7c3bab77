"""Small inline SVG charts drawn on the server (the admin loads nothing from
outside: the service's machines often have no internet)."""

from __future__ import annotations

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

COLORS = ("#417690", "#e0a526", "#79aec8", "#ba2121", "#5b8c38", "#8a5a9f", "#c46f2a")
FONT = 'font-family="sans-serif" font-size="11" fill="currentColor"'


def _n(number: float) -> str:
    return f"{number:.1f}"


def _color(index: int) -> str:
    return COLORS[index % len(COLORS)]


def _legend(names: list[str], x: float, y: float) -> SafeString:
    return format_html_join(
        "",
        '<rect x="{}" y="{}" width="10" height="10" fill="{}"/>'
        '<text x="{}" y="{}" ' + FONT + ">{}</text>",
        (
            (x + 130 * i, y, _color(i), x + 130 * i + 14, y + 9, name)
            for i, name in enumerate(names)
        ),
    )


def _svg(title: str, width: int, height: int, body: str) -> SafeString:
    # ``body`` is joined from format_html pieces only, so every value in it is escaped.
    return format_html(
        '<svg class="lmsp-chart" role="img" aria-label="{}" viewBox="0 0 {} {}" width="{}" '
        'height="{}" xmlns="http://www.w3.org/2000/svg"><title>{}</title>{}</svg>',
        title,
        width,
        height,
        width,
        height,
        title,
        mark_safe(body),
    )


def stacked_columns(title: str, labels: list[str], series: dict[str, list[int]]) -> SafeString:
    """One column per label, each series stacked on the others (hourly counts)."""
    width, height, left, top, bottom = 760, 240, 40, 28, 36
    plot_h = height - top - bottom
    step = (width - left - 10) / max(len(labels), 1)
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    peak = max(totals, default=0) or 1
    parts = [
        format_html(
            '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#999"/>',
            left,
            top + plot_h,
            width - 10,
            top + plot_h,
        ),
        format_html('<text x="4" y="{}" {}>{}</text>', top + 4, mark_safe(FONT), peak),
        format_html('<text x="4" y="{}" {}>0</text>', top + plot_h, mark_safe(FONT)),
        _legend(list(series), left, 4),
    ]
    for i, label in enumerate(labels):
        x = left + i * step + 1
        base = float(top + plot_h)
        for s, (name, values) in enumerate(series.items()):
            if not values[i]:
                continue
            h = values[i] / peak * plot_h
            base -= h
            parts.append(
                format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}">'
                    "<title>{} {}: {}</title></rect>",
                    _n(x),
                    _n(base),
                    _n(step - 2),
                    _n(h),
                    _color(s),
                    label,
                    name,
                    values[i],
                )
            )
        if i % 3 == 0:
            parts.append(
                format_html(
                    '<text x="{}" y="{}" {}>{}</text>', _n(x), height - 20, mark_safe(FONT), label
                )
            )
    return _svg(title, width, height, "".join(parts))


def grouped_bars(
    title: str, series_names: list[str], rows: list[tuple[str, list[int]]]
) -> SafeString:
    """Horizontal bars, one group per row (a model), one bar per series."""
    bar_h, gap, left, top, width = 14, 12, 150, 26, 760
    group_h = bar_h * len(series_names) + gap
    height = top + max(len(rows), 1) * group_h + 8
    peak = max((v for _, values in rows for v in values), default=0) or 1
    plot_w = width - left - 70
    parts = [_legend(series_names, left, 4)]
    if not rows:
        parts.append(
            format_html('<text x="{}" y="{}" {}>no data</text>', left, top + 12, mark_safe(FONT))
        )
    for r, (label, values) in enumerate(rows):
        y0 = top + r * group_h
        parts.append(
            format_html('<text x="4" y="{}" {}>{}</text>', y0 + bar_h, mark_safe(FONT), label)
        )
        for s, value in enumerate(values):
            y = y0 + s * bar_h
            w = value / peak * plot_w
            parts.append(
                format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{} {}: {}</title>'
                    '</rect><text x="{}" y="{}" {}>{}</text>',
                    left,
                    y,
                    _n(w),
                    bar_h - 2,
                    _color(s),
                    label,
                    series_names[s],
                    value,
                    _n(left + w + 4),
                    y + bar_h - 4,
                    mark_safe(FONT),
                    value,
                )
            )
    return _svg(title, width, height, "".join(parts))
