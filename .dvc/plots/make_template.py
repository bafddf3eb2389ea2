"""Writes .dvc/plots/offline.html: DVC's plots page with Vega, Vega-Lite and Vega-Embed inlined.

DVC's own page loads them from a CDN, so `dvc plots show/diff` is blank offline. `.dvc/config`
points `plots.html_template` here. Regenerate (only to change versions): `make plots-template`.
"""

from pathlib import Path

import vl_convert

# The bundle runs in its own function scope, so its top-level names cannot clash with the
# `var spec` of the plot scripts DVC writes. Vega-Lite 5: the major version of the specs DVC writes ($schema .../vega-lite/v5.json).
VEGA_LITE = "5.21"

PAGE = r"""<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <!-- Vega %(vega)s, Vega-Lite %(vega_lite)s, Vega-Embed %(embed)s (BSD-3-Clause), bundled by
         vl-convert %(vl_convert)s so the page renders offline; made by .dvc/plots/make_template.py -->
    <script>(() => {
%(bundle)s
})();</script>
    <style>
        body { font-family: sans-serif; }
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    <noscript>The plots need JavaScript.</noscript>
    <div id="plots"></div>
    <script>
        // DVC pastes each chart's data as it is into a script element on this page: a class
        // name holding a script end tag, or a comment opener before a script tag, would end or
        // swallow the scripts, and charts vanish. So DVC's charts land in the plaintext element
        // below, which no text can end, and are drawn from their JSON here: every label stays
        // data for Vega, never markup for the page. (Hence no such tags in this script either.)
        // DVC writes a chart as `var spec = <its JSON, one line>; vegaEmbed('#<id>', spec);`.
        const chart = /<script type = "text\/javascript">\s*var spec = (.*);\s*vegaEmbed\(.*\s*<\/script>/g;
        document.addEventListener("DOMContentLoaded", () => {
            const specs = [];
            const html = document.getElementById("dvc-plots").textContent.replace(chart, (_, spec) =>
                `<div class="vega-chart" data-i="${specs.push(JSON.parse(spec)) - 1}"></div>`);
            const plots = document.getElementById("plots");
            plots.innerHTML = html;  // DVC's layout and images, with no data in it any more
            // SVG, not Vega-Embed's default canvas: a chart's words and numbers (the counts in
            // the confusion cells) are then text on the page, found by Ctrl-F, sharp when zoomed.
            for (const el of plots.querySelectorAll(".vega-chart"))
                vegaEmbed(el, specs[el.dataset.i], {renderer: "svg"});
        });
    </script>
    <plaintext id="dvc-plots" hidden>{plot_divs}
"""

bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
assert "</script" not in bundle.lower(), "the bundle would end the inline <script> early"
page = PAGE % {"bundle": bundle, "vega": vl_convert.get_vega_version(), "vega_lite": VEGA_LITE,
               "embed": vl_convert.get_vega_embed_version(), "vl_convert": "1.9"}
Path(__file__).with_name("offline.html").write_text(page)
