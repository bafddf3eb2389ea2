"""Writes .dvc/plots/offline.html: DVC's plots page with Vega, Vega-Lite and Vega-Embed inlined.

DVC's own page loads them from a CDN, so `dvc plots show/diff` is blank offline. `.dvc/config`
points `plots.html_template` here. Regenerate (only to change versions): `make plots-template`.
"""

from pathlib import Path

import vl_convert

# The bundle runs in its own function scope, so its top-level names cannot clash with the
# `var spec` of the plot scripts DVC writes. Vega-Lite 5: the major version of the specs DVC writes ($schema .../vega-lite/v5.json).
VEGA_LITE = "5.21"

PAGE = """<!DOCTYPE html>
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
    {plot_divs}
</body>
</html>
"""

bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
assert "</script" not in bundle.lower(), "the bundle would end the inline <script> early"
page = PAGE % {"bundle": bundle, "vega": vl_convert.get_vega_version(), "vega_lite": VEGA_LITE,
               "embed": vl_convert.get_vega_embed_version(), "vl_convert": "1.9"}
Path(__file__).with_name("offline.html").write_text(page)
